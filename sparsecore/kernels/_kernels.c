/* Native kernels on the GGUF file's own blocks (sparsecore/kernels/__init__.py is the Python
 * side and says what each entry point is for).
 *
 * THE hot function is ffn_token: one process's partial FFN for one token, in one call, reading
 * only its own rows of the memory-mapped file (no copy, no gather):
 *     for each owned neuron n:  g = act(gate[n] . x); skip unless active; h[n] = g * (up[n] . x)
 *     y = down[:, owned] . h
 * Every matrix product is a row dot product on the file's blocks (Q4_0, Q4_1, Q8_0, F16, BF16,
 * F32, and the K-quants Q4_K, Q5_K, Q6_K in blocks of 256). Two arithmetic modes:
 *   exact: float32 activations times each block's dequantized values (d * q, exact in float32),
 *          summed per block and scaled: the products transformers computes on the dequantized
 *          matrix, in another summation order;
 *   fast:  the activation quantized once to 8 bits in blocks of 32 (as llama.cpp does), integer
 *          dot products per block, one float multiply per block (per sub-block of a K block: a
 *          K block of 256 spans 8 activation blocks).
 * SIMD: AVX2 (+FMA, F16C) chosen at run time where the CPU has it, else portable C; both give
 * the same integer sums in fast mode and the same products up to summation order in exact mode.
 * Where the CPU has AVX-512 VNNI (ISA level "avx512vnni"), fast mode's quantized dots use
 * vpdpbusd instead (everything else stays AVX2): the same integer sums, another float order,
 * one and the same for a token alone and in any batch.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <math.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define HAVE_X86 1
#define AVX2 __attribute__((target("avx2,fma,f16c")))
#else
#define HAVE_X86 0
#endif

/* GGML type ids (gguf.GGMLQuantizationType) */
enum { T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q8_0 = 8, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_BF16 = 30 };
#define QK 32
#define QKK 256  /* values per block of the K-quants */
#define MAXB 16  /* most tokens of a small batch (matmul, ffn_batch): accumulators live on the stack */

/* ---- scalar helpers ------------------------------------------------------------------------ */

static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) bits = sign;
        else {  /* subnormal: normalize */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) { man <<= 1; exp--; }
            bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) bits = sign | 0x7f800000 | (man << 13);
    else bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t rd16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }

/* A per-thread scratch buffer of at least `bytes`, grown on demand and kept (calls release the
 * GIL: every thread its own); NULL if it cannot grow. */
static void *grown(void **buf, int64_t *cap, int64_t bytes) {
    if (bytes > *cap) {
        free(*buf);
        *buf = malloc(bytes > 0 ? bytes : 1);
        *cap = *buf ? bytes : 0;
    }
    return *buf;
}
static inline int32_t rd32(const void *p) { int32_t v; memcpy(&v, p, 4); return v; }

/* Rows whose blocks are interleaved 16 by 16 within the row (R16): a Q4_0, Q4_1 or Q8_0 matrix
 * repacked in memory of the process's own for fast mode's products of rows picked one by one
 * (FileMatrix.interleave_blocks). Each row keeps its place and its bytes (row_at works); every
 * 16 consecutive blocks of it (512 values) are laid out as X16 lays out 16 rows' block, the
 * block standing for the row. Type id R16 + the file's type; a row's size and block are the
 * file type's. */
#define R16 200
static inline int is_r16(int t) { return t == R16 + T_Q4_0 || t == R16 + T_Q4_1 || t == R16 + T_Q8_0; }

static inline int is_kquant(int t) { return t == T_Q4_K || t == T_Q5_K || t == T_Q6_K; }
static int block_size(int t) {
    if (is_r16(t)) t -= R16;
    return (t == T_F32 || t == T_F16 || t == T_BF16) ? 1 : is_kquant(t) ? QKK : QK;
}
static int type_bytes(int t) {  /* bytes of one block */
    if (is_r16(t)) t -= R16;
    switch (t) {
    case T_F32: return 4; case T_F16: case T_BF16: return 2;
    case T_Q4_0: return 18; case T_Q4_1: return 20; case T_Q8_0: return 34;
    case T_Q4_K: return 144; case T_Q5_K: return 176; case T_Q6_K: return 210;
    default: return 0;
    }
}
/* quantized types: fast mode quantizes the activation to q8 blocks */
static inline int is_quant(int t) { return block_size(t) >= QK; }

/* Interleaved rows (X16): a Q4_0, Q4_1 or Q8_0 matrix repacked in memory of the process's own, 16
 * rows side by side, for fast mode's dense products (interleave() below, FileMatrix.interleave).
 * Its type id is X16 + the file's type; it has no single rows (no row_at, no row lists). */
#define X16 100
static inline int is_x16(int t) {
    return t == X16 + T_Q4_0 || t == X16 + T_Q4_1 || t == X16 + T_Q8_0 || t == X16 + T_Q6_K || t == X16 + T_Q4_K;
}
/* bytes of an X16 (group, block): 16 of the file's blocks, and Q4_K's scales and mins unpacked
 * to a byte each (16 rows x 8 sub-blocks x 2 bytes, against 16 x 12 packed: 2.8 % more) */
static inline int x16_block_bytes(int t) { return t == X16 + T_Q4_K ? 2368 : 16 * type_bytes(t - X16); }
/* A run of L lanes (interleave_run: X16's 16 rows' block, or R16's blocks of a row): bytes
 * before its values, its L f16 scales (and Q4_1's L f16 mins); t the file's type */
static inline int run_head(int t, int L) { return (t == T_Q4_1 ? 4 : 2) * L; }
/* the stored unsigned value i of lane r in a run of L lanes: Q4 a nibble, Q8_0 q + 128 */
static inline int run_value(int t, const uint8_t *p, int L, int r, int i) {
    int h = run_head(t, L);
    if (t == T_Q8_0) return p[h + 4 * L * (i / 4) + 4 * r + i % 4];
    int l = i % 16;
    return (p[h + 4 * L * (l / 4) + 4 * r + l % 4] >> (4 * (i / 16))) & 15;
}
/* x's offset in each lane's integer sum: Q4_0's values are u - 8, Q8_0's stored u = q + 128 */
static inline int32_t x16_offset(int t, int32_t sx) { return t == X16 + T_Q4_0 ? -8 * sx : t == X16 + T_Q8_0 ? -128 * sx : 0; }
/* Q6_K's X16 block (16 rows x 256 values, 3360 bytes): the rows' f16 d, then per activation
 * block xb (32 values, sub-blocks 2 xb and 2 xb + 1) 416 bytes in the order the tile reads
 * them: the two sub-blocks' int8 scales (16 rows each), 4 runs of low nibbles, 2 runs of high
 * bits (interleave_q6k). One forward stream: with the scales, low and high bits in three
 * regions of the block, one core read it from memory at 11-13 GB/s, now 18.6-18.9 (Q4_0's
 * single stream: 25). */
#define Q6_SC(j) (32 + 416 * ((j) / 2) + 16 * ((j) % 2))       /* sub-block j's 16 scales */
#define Q6_L(m) (32 + 416 * ((m) / 4) + 32 + 64 * ((m) % 4))   /* low nibbles of values 8m..8m+7 */
#define Q6_H(n) (32 + 416 * ((n) / 2) + 288 + 64 * ((n) % 2))  /* high bits of values 16n..16n+15 */
/* Q4_K's (2368 bytes): the rows' f16 d, then dmin, then per sub-block pair p (576 bytes) the
 * two sub-blocks' scales and mins (a byte each, 16 rows), then their 8 runs of nibbles; the
 * same one stream (one core, from memory: 20 -> 22.6-25.1 GB/s) */
#define Q4K_SC(sb) (64 + 576 * ((sb) / 2) + 16 * ((sb) % 2))       /* sub-block sb's 16 scales */
#define Q4K_MN(sb) (64 + 576 * ((sb) / 2) + 32 + 16 * ((sb) % 2))  /* and mins */
#define Q4K_V(p) (64 + 576 * (p) + 64)                             /* sub-blocks 2p, 2p + 1's values */

/* ---- K-quant blocks (ggml's layouts), 256 values each ----------------------------------------
 * Q4_K (144 bytes): f16 d, f16 dmin, 12 bytes of 6-bit scales sc[8] and mins m[8] packed, 128
 *   bytes qs. Sub-block j (32 values) of q: nibbles of qs[32 (j/2) ..+32], low ones for even j,
 *   high ones for odd j. Value = d sc[j] q - dmin m[j].
 * Q5_K (176 bytes): d, dmin, the 12 scale bytes, 32 bytes qh, 128 bytes qs as Q4_K; value i of
 *   sub-block j gets bit j of qh[i] as its fifth bit (q in 0..31).
 * Q6_K (210 bytes): 128 bytes ql (low 4 bits), 64 bytes qh (high 2 bits), int8 sc[16] (one per
 *   16 values), f16 d. Half h (128 values): value 32 k + l (k < 4, l < 32) has low bits
 *   ql[64 h + 32 (k & 1) + l] >> 4 (k >> 1) and high bits qh[32 h + l] >> 2 k; value = d sc (q - 32). */

/* 6-bit scale and min of sub-block j from Q4_K/Q5_K's 12 packed bytes */
static inline void kscale_min(const uint8_t *s, int j, int *sc, int *m) {
    if (j < 4) { *sc = s[j] & 63; *m = s[j + 4] & 63; }
    else { *sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4); *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4); }
}

/* One K block as int8 values (Q4_K/Q5_K: 0..31, Q6_K: q - 32) and per sub-block float scale
 * and min (value = scl q - mn); returns the sub-block size (32, or 16 for Q6_K). */
static int kunpack(int t, const uint8_t *w, int8_t *q, float *scl, float *mn) {
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

/* An activation quantized for fast mode: per block of 32, int8 values, their float scale and
 * the sum of the int8 values (Q4_0's -8 offset and Q4_1's min need it). */
typedef struct { float d; int32_t s; int8_t q[QK]; } q8blk;

/* Fast mode with VNNI: a token's q8 blocks 2i and 2i+1 as its steps read them (vnni_pack) */
typedef struct { _Alignas(64) int8_t q[2 * QK]; } xpair;

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
    case T_Q4_K: case T_Q5_K: case T_Q6_K: {
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
                } else {  /* Q6_K: two sub-blocks of 16, signed q - 32, no min */
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
    case T_Q4_K: case T_Q5_K: case T_Q6_K: {
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

/* ---- dot products, AVX2 -------------------------------------------------------------------- */
#if HAVE_X86
/* f16_to_f32 in one instruction (F16C: exact, as the portable conversion; the axpy and dot
 * loops of one-row products converted a scale per block, some 20 instructions each) */
AVX2 static inline float f16c_f32(uint16_t h) { return _cvtsh_ss(h); }

AVX2 static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 32 unsigned nibbles of a Q4 block as 32 bytes: low nibbles first, then high (GGUF order) */
AVX2 static inline __m256i nibbles(const uint8_t *qs) {
    __m128i t = _mm_loadu_si128((const __m128i *)qs);
    __m256i both = _mm256_set_m128i(_mm_srli_epi16(t, 4), t);
    return _mm256_and_si256(both, _mm256_set1_epi8(15));
}

/* sum of 8 int8 lanes times floats: 32 bytes b (int8) . 32 floats x, as a vector of 8 partials */
AVX2 static inline __m256 i8x32_dot_f(__m256i b, const float *x, __m256 acc, __m256 scale) {
    __m128i lo = _mm256_castsi256_si128(b), hi = _mm256_extracti128_si256(b, 1);
    __m256 p = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)), _mm256_loadu_ps(x));
    p = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))), _mm256_loadu_ps(x + 8), p);
    p = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)), _mm256_loadu_ps(x + 16), p);
    p = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))), _mm256_loadu_ps(x + 24), p);
    return _mm256_fmadd_ps(p, scale, acc);
}

/* the same with one scale for the first 16 bytes and another for the last 16 (Q6_K) */
AVX2 static inline __m256 i8x32_dot_f2(__m256i b, const float *x, __m256 acc, __m256 s_lo, __m256 s_hi) {
    __m128i lo = _mm256_castsi256_si128(b), hi = _mm256_extracti128_si256(b, 1);
    __m256 p = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)), _mm256_loadu_ps(x));
    p = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))), _mm256_loadu_ps(x + 8), p);
    __m256 q = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)), _mm256_loadu_ps(x + 16));
    q = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))), _mm256_loadu_ps(x + 24), q);
    return _mm256_fmadd_ps(q, s_hi, _mm256_fmadd_ps(p, s_lo, acc));
}

/* A K block's 256 values as 8 vectors of 32 unsigned bytes, one per 32 consecutive values:
 * Q4_K 0..15, Q5_K 0..31, Q6_K 0..63 (before its -32). */
AVX2 static inline void kq_unpack(int t, const uint8_t *w, __m256i q[8]) {
    const __m256i m4 = _mm256_set1_epi8(15), m1 = _mm256_set1_epi8(1), m2 = _mm256_set1_epi8(3);
    if (t == T_Q6_K) {
        for (int h = 0; h < 2; h++) {  /* half h: ql[64h..+64] (two vectors), qh[32h..+32] */
            __m256i a = _mm256_loadu_si256((const __m256i *)(w + 64 * h)), b = _mm256_loadu_si256((const __m256i *)(w + 64 * h + 32));
            __m256i hb = _mm256_loadu_si256((const __m256i *)(w + 128 + 32 * h));
            /* high bits: 2 per value, to bits 4..5 (mask per byte first: the 16-bit shifts cross bytes) */
            q[4 * h + 0] = _mm256_or_si256(_mm256_and_si256(a, m4), _mm256_slli_epi16(_mm256_and_si256(hb, m2), 4));
            q[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(b, m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2), m2), 4));
            q[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), m4),
                                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 4), m2), 4));
            q[4 * h + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b, 4), m4),
                                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 6), m2), 4));
        }
        return;
    }
    const uint8_t *qs = w + (t == T_Q5_K ? 48 : 16);
    __m256i hb = t == T_Q5_K ? _mm256_loadu_si256((const __m256i *)(w + 16)) : _mm256_setzero_si256();
    for (int k = 0; k < 4; k++) {  /* 32 bytes of qs: sub-block 2k in the low nibbles, 2k+1 in the high */
        __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * k));
        q[2 * k] = _mm256_and_si256(v, m4);
        q[2 * k + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
        if (t == T_Q5_K) {  /* bit j of qh is sub-block j's fifth bit: shift qh down one bit per sub-block */
            q[2 * k] = _mm256_or_si256(q[2 * k], _mm256_slli_epi16(_mm256_and_si256(hb, m1), 4));
            q[2 * k + 1] = _mm256_or_si256(q[2 * k + 1], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 1), m1), 4));
            hb = _mm256_srli_epi16(hb, 2);
        }
    }
}


/* Q4_K/Q5_K: each sub-block's scale d sc[j] and min dmin m[j], in vectors: the 12 scale bytes as three little-endian words
 * s0, s1, s2 give the 6-bit scales 0..3 as s0's bytes & 63 and 4..7 as s2's low nibbles with
 * s0's top two bits above them; the mins likewise from s1 and s2's high nibbles. Scalar, the
 * unpacking and 16 conversions cost about as much as a super-block's products (one token's
 * Q4_K rows ran at 8 GB/s on a core with VNNI, Q4_0's at 22). scl: the scales d sc[j] in lanes
 * 0..7; mn: the mins dmin m[j]. */
AVX2 static inline void k45_scales_vec(const uint8_t *w, __m256 *scl, __m256 *mn) {
    uint32_t s0, s1, s2;
    memcpy(&s0, w + 4, 4), memcpy(&s1, w + 8, 4), memcpy(&s2, w + 12, 4);
    const uint32_t m6 = 0x3f3f3f3fu, m4 = 0x0f0f0f0fu, m2 = 0x03030303u;
    uint32_t sc_hi = (s2 & m4) | (((s0 >> 6) & m2) << 4), mn_hi = ((s2 >> 4) & m4) | (((s1 >> 6) & m2) << 4);
    __m128i sc8 = _mm_set_epi32(0, 0, (int)sc_hi, (int)(s0 & m6)), mn8 = _mm_set_epi32(0, 0, (int)mn_hi, (int)(s1 & m6));
    __m256 d = _mm256_set1_ps(_cvtsh_ss(rd16(w))), dmin = _mm256_set1_ps(_cvtsh_ss(rd16(w + 2)));
    *scl = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sc8)));
    *mn = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(mn8)));
}
AVX2 static inline void k45_scales_avx2(const uint8_t *w, float *scl, float *mn) {
    __m256 a, b;
    k45_scales_vec(w, &a, &b);
    _mm256_storeu_ps(scl, a);
    _mm256_storeu_ps(mn, b);
}

AVX2 static float dot_exact_avx2(int t, const uint8_t *w, const float *x, int n) {
    __m256 acc = _mm256_setzero_ps();
    int nb = n / QK;
    switch (t) {
    case T_F32: {
        const float *f = (const float *)w;
        int i = 0;
        for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(f + i), _mm256_loadu_ps(x + i), acc);
        float r = hsum8(acc);
        for (; i < n; i++) r += f[i] * x[i];
        return r;
    }
    case T_F16: {
        int i = 0;
        for (; i + 8 <= n; i += 8)
            acc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + 2 * i))), _mm256_loadu_ps(x + i), acc);
        float r = hsum8(acc);
        for (; i < n; i++) r += f16c_f32(rd16(w + 2 * i)) * x[i];
        return r;
    }
    case T_Q4_0: {
        const __m256i eight = _mm256_set1_epi8(8);
        for (int b = 0; b < nb; b++, w += 18, x += QK)
            acc = i8x32_dot_f(_mm256_sub_epi8(nibbles(w + 2), eight), x, acc, _mm256_set1_ps(f16c_f32(rd16(w))));
        return hsum8(acc);
    }
    case T_Q4_1: {
        __m256 accm = _mm256_setzero_ps();
        for (int b = 0; b < nb; b++, w += 20, x += QK) {
            acc = i8x32_dot_f(nibbles(w + 4), x, acc, _mm256_set1_ps(f16c_f32(rd16(w))));
            __m256 sx = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(x), _mm256_loadu_ps(x + 8)),
                                      _mm256_add_ps(_mm256_loadu_ps(x + 16), _mm256_loadu_ps(x + 24)));
            accm = _mm256_fmadd_ps(sx, _mm256_set1_ps(f16c_f32(rd16(w + 2))), accm);
        }
        return hsum8(_mm256_add_ps(acc, accm));
    }
    case T_Q8_0:
        for (int b = 0; b < nb; b++, w += 34, x += QK)
            acc = i8x32_dot_f(_mm256_loadu_si256((const __m256i *)(w + 2)), x, acc, _mm256_set1_ps(f16c_f32(rd16(w))));
        return hsum8(acc);
    case T_Q4_K: case T_Q5_K: {
        __m256 accm = _mm256_setzero_ps();
        float scl[8], mn[8];
        __m256i q[8];
        for (int b = 0; b < n / QKK; b++, w += type_bytes(t)) {
            k45_scales_avx2(w, scl, mn);
            kq_unpack(t, w, q);
            for (int j = 0; j < 8; j++, x += QK) {  /* scale . (q . x) - min . sum(x), per sub-block of 32 */
                acc = i8x32_dot_f(q[j], x, acc, _mm256_set1_ps(scl[j]));
                __m256 sx = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(x), _mm256_loadu_ps(x + 8)),
                                          _mm256_add_ps(_mm256_loadu_ps(x + 16), _mm256_loadu_ps(x + 24)));
                accm = _mm256_fmadd_ps(sx, _mm256_set1_ps(mn[j]), accm);
            }
        }
        return hsum8(_mm256_sub_ps(acc, accm));
    }
    case T_Q6_K: {
        const __m256i c32 = _mm256_set1_epi8(32);
        __m256i q[8];
        for (int b = 0; b < n / QKK; b++, w += 210) {
            const int8_t *sc = (const int8_t *)(w + 192);
            float d = f16c_f32(rd16(w + 208));
            kq_unpack(t, w, q);
            for (int j = 0; j < 8; j++, x += QK)  /* two sub-blocks of 16, values q - 32 */
                acc = i8x32_dot_f2(_mm256_sub_epi8(q[j], c32), x, acc, _mm256_set1_ps(d * (float)sc[2 * j]),
                                   _mm256_set1_ps(d * (float)sc[2 * j + 1]));
        }
        return hsum8(acc);
    }
    default:
        return dot_exact_c(t, w, x, n);
    }
}

/* unsigned bytes u (0..127 or 0..15) times signed bytes s, summed to 8 int32 lanes */
AVX2 static inline __m256i dot_u8s8(__m256i u, __m256i s) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

AVX2 static float dot_fast_avx2(int t, const uint8_t *w, const q8blk *xq, int nb) {
    __m256 acc = _mm256_setzero_ps();
    float extra = 0.f;  /* per-block offset terms (Q4_0's -8, Q4_1's min), summed in scalar */
    switch (t) {
    case T_Q4_0:
        for (int b = 0; b < nb; b++, w += 18, xq++) {
            float dd = f16c_f32(rd16(w)) * xq->d;
            __m256i s = dot_u8s8(nibbles(w + 2), _mm256_loadu_si256((const __m256i *)xq->q));
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(dd), acc);
            extra -= 8.f * dd * (float)xq->s;
        }
        return hsum8(acc) + extra;
    case T_Q4_1:
        for (int b = 0; b < nb; b++, w += 20, xq++) {
            __m256i s = dot_u8s8(nibbles(w + 4), _mm256_loadu_si256((const __m256i *)xq->q));
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(f16c_f32(rd16(w)) * xq->d), acc);
            extra += f16c_f32(rd16(w + 2)) * xq->d * (float)xq->s;
        }
        return hsum8(acc) + extra;
    case T_Q8_0:
        for (int b = 0; b < nb; b++, w += 34, xq++) {
            __m256i wq = _mm256_loadu_si256((const __m256i *)(w + 2)), xv = _mm256_loadu_si256((const __m256i *)xq->q);
            /* |w| times x with w's sign: the unsigned-by-signed product maddubs takes */
            __m256i s = dot_u8s8(_mm256_sign_epi8(wq, wq), _mm256_sign_epi8(xv, wq));
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(f16c_f32(rd16(w)) * xq->d), acc);
        }
        return hsum8(acc);
    case T_Q4_K: case T_Q5_K: {  /* sub-block j of 32 is q8 block j of the 8 a K block spans */
        float scl[8], mn[8];
        __m256i q[8];
        __m256 acc2 = _mm256_setzero_ps();
        for (int b = 0; b < nb / 8; b++, w += type_bytes(t)) {
            k45_scales_avx2(w, scl, mn);
            kq_unpack(t, w, q);
            for (int j = 0; j < 8; j += 2, xq += 2) {
                __m256i s0 = dot_u8s8(q[j], _mm256_loadu_si256((const __m256i *)xq[0].q));
                __m256i s1 = dot_u8s8(q[j + 1], _mm256_loadu_si256((const __m256i *)xq[1].q));
                acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), _mm256_set1_ps(scl[j] * xq[0].d), acc);
                acc2 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), _mm256_set1_ps(scl[j + 1] * xq[1].d), acc2);
                extra -= mn[j] * xq[0].d * (float)xq[0].s + mn[j + 1] * xq[1].d * (float)xq[1].s;
            }
        }
        return hsum8(_mm256_add_ps(acc, acc2)) + extra;
    }
    case T_Q6_K: {  /* q8 block j holds sub-blocks 2j (its first 16 values) and 2j+1 */
        const __m256i c32 = _mm256_set1_epi8(32);
        __m256i q[8];
        for (int b = 0; b < nb / 8; b++, w += 210) {
            const int8_t *sc = (const int8_t *)(w + 192);
            float d = f16c_f32(rd16(w + 208));
            kq_unpack(t, w, q);
            for (int j = 0; j < 8; j++, xq++) {
                __m256i xv = _mm256_loadu_si256((const __m256i *)xq->q);
                /* pairs of q x - 32 x in int16 (|.| <= 63 * 127 * 2), then times each half's scale */
                __m256i p = _mm256_sub_epi16(_mm256_maddubs_epi16(q[j], xv), _mm256_maddubs_epi16(c32, xv));
                __m256i s = _mm256_madd_epi16(p, _mm256_set_m128i(_mm_set1_epi16(sc[2 * j + 1]), _mm_set1_epi16(sc[2 * j])));
                acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(d * xq->d), acc);
            }
        }
        return hsum8(acc);
    }
    default:
        return dot_fast_c(t, w, xq, nb);
    }
}

/* y (32 floats) += scale * b (32 int8) + bias */
AVX2 static inline void i8x32_axpy(__m256i b, float *y, __m256 scale, __m256 bias) {
    __m128i lo = _mm256_castsi256_si128(b), hi = _mm256_extracti128_si256(b, 1);
    __m256i q[4] = {_mm256_cvtepi8_epi32(lo), _mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)),
                    _mm256_cvtepi8_epi32(hi), _mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))};
    for (int k = 0; k < 4; k++)
        _mm256_storeu_ps(y + 8 * k, _mm256_add_ps(_mm256_fmadd_ps(_mm256_cvtepi32_ps(q[k]), scale, bias),
                                                  _mm256_loadu_ps(y + 8 * k)));
}

/* y (32 floats) += s_lo * b[0..16) , s_hi * b[16..32) (int8) */
AVX2 static inline void i8x32_axpy2(__m256i b, float *y, __m256 s_lo, __m256 s_hi) {
    __m128i lo = _mm256_castsi256_si128(b), hi = _mm256_extracti128_si256(b, 1);
    __m256i q[4] = {_mm256_cvtepi8_epi32(lo), _mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)),
                    _mm256_cvtepi8_epi32(hi), _mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))};
    for (int k = 0; k < 4; k++)
        _mm256_storeu_ps(y + 8 * k, _mm256_fmadd_ps(_mm256_cvtepi32_ps(q[k]), k < 2 ? s_lo : s_hi, _mm256_loadu_ps(y + 8 * k)));
}

AVX2 static void axpy_avx2(int t, const uint8_t *w, float a, float *y, int n) {
    const __m256 zero = _mm256_setzero_ps();
    switch (t) {
    case T_Q4_0:
        for (int b = 0; b < n / QK; b++, w += 18, y += QK)
            i8x32_axpy(_mm256_sub_epi8(nibbles(w + 2), _mm256_set1_epi8(8)), y, _mm256_set1_ps(a * f16c_f32(rd16(w))), zero);
        return;
    case T_Q4_1:
        for (int b = 0; b < n / QK; b++, w += 20, y += QK)
            i8x32_axpy(nibbles(w + 4), y, _mm256_set1_ps(a * f16c_f32(rd16(w))), _mm256_set1_ps(a * f16c_f32(rd16(w + 2))));
        return;
    case T_Q8_0:
        for (int b = 0; b < n / QK; b++, w += 34, y += QK)
            i8x32_axpy(_mm256_loadu_si256((const __m256i *)(w + 2)), y, _mm256_set1_ps(a * f16c_f32(rd16(w))), zero);
        return;
    case T_Q4_K: case T_Q5_K: {
        float scl[8], mn[8];
        __m256i q[8];
        for (int b = 0; b < n / QKK; b++, w += type_bytes(t)) {
            k45_scales_avx2(w, scl, mn);
            kq_unpack(t, w, q);
            for (int j = 0; j < 8; j++, y += QK)
                i8x32_axpy(q[j], y, _mm256_set1_ps(a * scl[j]), _mm256_set1_ps(-a * mn[j]));
        }
        return;
    }
    case T_Q6_K: {
        const __m256i c32 = _mm256_set1_epi8(32);
        __m256i q[8];
        for (int b = 0; b < n / QKK; b++, w += 210) {
            const int8_t *sc = (const int8_t *)(w + 192);
            float ad = a * f16c_f32(rd16(w + 208));
            kq_unpack(t, w, q);
            for (int j = 0; j < 8; j++, y += QK)
                i8x32_axpy2(_mm256_sub_epi8(q[j], c32), y, _mm256_set1_ps(ad * (float)sc[2 * j]), _mm256_set1_ps(ad * (float)sc[2 * j + 1]));
        }
        return;
    }
    case T_F32: {
        const float *f = (const float *)w;
        int i = 0;
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(y + i, _mm256_fmadd_ps(_mm256_loadu_ps(f + i), _mm256_set1_ps(a), _mm256_loadu_ps(y + i)));
        for (; i < n; i++) y[i] += a * f[i];
        return;
    }
    default:
        axpy_c(t, w, a, y, n);
    }
}

/* ---- several tokens per row (continuous batching), AVX2 ------------------------------------
 * A row's block is loaded and unpacked once (to int8 lanes, and to floats in exact mode) and
 * then used for each of the B tokens. Per token the float operations are the one-token
 * kernel's above, in the same order: a token's result does not depend on its batch. x: token b
 * at x + b ldx (exact) or xq + b ldq (fast); y: token b's dot at y[b ldy]. */

/* 32 int8 values as 4 vectors of 8 floats (exact conversions, so hoisting them changes nothing) */
AVX2 static inline void i8x32_to_f(__m256i b, __m256 f[4]) {
    __m128i lo = _mm256_castsi256_si128(b), hi = _mm256_extracti128_si256(b, 1);
    f[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
    f[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
    f[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
    f[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
}

/* i8x32_dot_f and i8x32_dot_f2 on values already converted */
AVX2 static inline __m256 f32x32_dot(const __m256 f[4], const float *x, __m256 acc, __m256 scale) {
    __m256 p = _mm256_mul_ps(f[0], _mm256_loadu_ps(x));
    p = _mm256_fmadd_ps(f[1], _mm256_loadu_ps(x + 8), p);
    p = _mm256_fmadd_ps(f[2], _mm256_loadu_ps(x + 16), p);
    p = _mm256_fmadd_ps(f[3], _mm256_loadu_ps(x + 24), p);
    return _mm256_fmadd_ps(p, scale, acc);
}

AVX2 static inline __m256 f32x32_dot2(const __m256 f[4], const float *x, __m256 acc, __m256 s_lo, __m256 s_hi) {
    __m256 p = _mm256_mul_ps(f[0], _mm256_loadu_ps(x));
    p = _mm256_fmadd_ps(f[1], _mm256_loadu_ps(x + 8), p);
    __m256 q = _mm256_mul_ps(f[2], _mm256_loadu_ps(x + 16));
    q = _mm256_fmadd_ps(f[3], _mm256_loadu_ps(x + 24), q);
    return _mm256_fmadd_ps(q, s_hi, _mm256_fmadd_ps(p, s_lo, acc));
}

AVX2 static inline __m256 sum32(const float *x) {
    return _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(x), _mm256_loadu_ps(x + 8)),
                         _mm256_add_ps(_mm256_loadu_ps(x + 16), _mm256_loadu_ps(x + 24)));
}

/* Tokens go through in tiles of up to TILE: inlined with a constant count, a tile's
 * accumulators stay in registers (with a run-time count they lived on the stack, a store and a
 * load in every accumulation); the row is decoded once per tile, from L1 after the first. */
#define TILE 4
#define INLINE inline __attribute__((always_inline))

AVX2 static INLINE void dots_exact_tile(int t, const uint8_t *w, const float *x, int64_t ldx, int n, int B, float *y, int64_t ldy) {
    __m256 acc[TILE], accm[TILE], f[4];
    for (int b = 0; b < B; b++) acc[b] = accm[b] = _mm256_setzero_ps();
    int nb = n / QK;
    switch (t) {
    case T_F32: {
        const float *fw = (const float *)w;
        int i = 0;
        for (; i + 8 <= n; i += 8) {
            __m256 wv = _mm256_loadu_ps(fw + i);
            for (int b = 0; b < B; b++) acc[b] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + b * ldx + i), acc[b]);
        }
        for (int b = 0; b < B; b++) {
            const float *xb = x + b * ldx;
            float r = hsum8(acc[b]);
            for (int k = i; k < n; k++) r += fw[k] * xb[k];
            y[b * ldy] = r;
        }
        return;
    }
    case T_F16: {
        int i = 0;
        for (; i + 8 <= n; i += 8) {
            __m256 wv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + 2 * i)));
            for (int b = 0; b < B; b++) acc[b] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + b * ldx + i), acc[b]);
        }
        for (int b = 0; b < B; b++) {
            const float *xb = x + b * ldx;
            float r = hsum8(acc[b]);
            for (int k = i; k < n; k++) r += f16c_f32(rd16(w + 2 * k)) * xb[k];
            y[b * ldy] = r;
        }
        return;
    }
    case T_Q4_0: case T_Q8_0: {
        const __m256i eight = _mm256_set1_epi8(8);
        int bytes = type_bytes(t);
        for (int k = 0; k < nb; k++, w += bytes) {
            i8x32_to_f(t == T_Q4_0 ? _mm256_sub_epi8(nibbles(w + 2), eight) : _mm256_loadu_si256((const __m256i *)(w + 2)), f);
            __m256 sc = _mm256_set1_ps(f16c_f32(rd16(w)));
            for (int b = 0; b < B; b++) acc[b] = f32x32_dot(f, x + b * ldx + k * QK, acc[b], sc);
        }
        for (int b = 0; b < B; b++) y[b * ldy] = hsum8(acc[b]);
        return;
    }
    case T_Q4_1:
        for (int k = 0; k < nb; k++, w += 20) {
            i8x32_to_f(nibbles(w + 4), f);
            __m256 sc = _mm256_set1_ps(f16c_f32(rd16(w))), mn = _mm256_set1_ps(f16c_f32(rd16(w + 2)));
            for (int b = 0; b < B; b++) {
                const float *xb = x + b * ldx + k * QK;
                acc[b] = f32x32_dot(f, xb, acc[b], sc);
                accm[b] = _mm256_fmadd_ps(sum32(xb), mn, accm[b]);
            }
        }
        for (int b = 0; b < B; b++) y[b * ldy] = hsum8(_mm256_add_ps(acc[b], accm[b]));
        return;
    case T_Q4_K: case T_Q5_K: {
        float scl[8], mn[8];
        __m256i q[8];
        for (int k = 0; k < n / QKK; k++, w += type_bytes(t)) {
            k45_scales_avx2(w, scl, mn);
            kq_unpack(t, w, q);
            for (int j = 0; j < 8; j++) {
                i8x32_to_f(q[j], f);
                __m256 sc = _mm256_set1_ps(scl[j]), m = _mm256_set1_ps(mn[j]);
                for (int b = 0; b < B; b++) {
                    const float *xb = x + b * ldx + k * QKK + j * QK;
                    acc[b] = f32x32_dot(f, xb, acc[b], sc);
                    accm[b] = _mm256_fmadd_ps(sum32(xb), m, accm[b]);
                }
            }
        }
        for (int b = 0; b < B; b++) y[b * ldy] = hsum8(_mm256_sub_ps(acc[b], accm[b]));
        return;
    }
    case T_Q6_K: {
        const __m256i c32 = _mm256_set1_epi8(32);
        __m256i q[8];
        for (int k = 0; k < n / QKK; k++, w += 210) {
            const int8_t *sc = (const int8_t *)(w + 192);
            float d = f16c_f32(rd16(w + 208));
            kq_unpack(t, w, q);
            for (int j = 0; j < 8; j++) {
                i8x32_to_f(_mm256_sub_epi8(q[j], c32), f);
                __m256 s_lo = _mm256_set1_ps(d * (float)sc[2 * j]), s_hi = _mm256_set1_ps(d * (float)sc[2 * j + 1]);
                for (int b = 0; b < B; b++) acc[b] = f32x32_dot2(f, x + b * ldx + k * QKK + j * QK, acc[b], s_lo, s_hi);
            }
        }
        for (int b = 0; b < B; b++) y[b * ldy] = hsum8(acc[b]);
        return;
    }
    default:
        for (int b = 0; b < B; b++) y[b * ldy] = dot_exact_c(t, w, x + b * ldx, n);
    }
}

AVX2 static INLINE void dots_fast_tile(int t, const uint8_t *w, const q8blk *xq, int64_t ldq, int nb, int B, float *y, int64_t ldy) {
    __m256 acc[TILE], acc2[TILE];
    float extra[TILE];  /* as dot_fast_avx2: per-block offset terms summed in scalar */
    for (int b = 0; b < B; b++) { acc[b] = acc2[b] = _mm256_setzero_ps(); extra[b] = 0.f; }
    switch (t) {
    case T_Q4_0:
        for (int k = 0; k < nb; k++, w += 18) {
            __m256i u = nibbles(w + 2);
            float d = f16c_f32(rd16(w));
            for (int b = 0; b < B; b++) {
                const q8blk *xb = xq + b * ldq + k;
                float dd = d * xb->d;
                __m256i s = dot_u8s8(u, _mm256_loadu_si256((const __m256i *)xb->q));
                acc[b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(dd), acc[b]);
                extra[b] -= 8.f * dd * (float)xb->s;
            }
        }
        for (int b = 0; b < B; b++) y[b * ldy] = hsum8(acc[b]) + extra[b];
        return;
    case T_Q4_1:
        for (int k = 0; k < nb; k++, w += 20) {
            __m256i u = nibbles(w + 4);
            float d = f16c_f32(rd16(w)), m = f16c_f32(rd16(w + 2));
            for (int b = 0; b < B; b++) {
                const q8blk *xb = xq + b * ldq + k;
                __m256i s = dot_u8s8(u, _mm256_loadu_si256((const __m256i *)xb->q));
                acc[b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(d * xb->d), acc[b]);
                extra[b] += m * xb->d * (float)xb->s;
            }
        }
        for (int b = 0; b < B; b++) y[b * ldy] = hsum8(acc[b]) + extra[b];
        return;
    case T_Q8_0:
        for (int k = 0; k < nb; k++, w += 34) {
            __m256i wq = _mm256_loadu_si256((const __m256i *)(w + 2)), wa = _mm256_sign_epi8(wq, wq);
            float d = f16c_f32(rd16(w));
            for (int b = 0; b < B; b++) {
                const q8blk *xb = xq + b * ldq + k;
                __m256i s = dot_u8s8(wa, _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)xb->q), wq));
                acc[b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(d * xb->d), acc[b]);
            }
        }
        for (int b = 0; b < B; b++) y[b * ldy] = hsum8(acc[b]);
        return;
    case T_Q4_K: case T_Q5_K: {
        float scl[8], mn[8];
        __m256i q[8];
        for (int k = 0; k < nb / 8; k++, w += type_bytes(t)) {
            k45_scales_avx2(w, scl, mn);
            kq_unpack(t, w, q);
            for (int j = 0; j < 8; j += 2)
                for (int b = 0; b < B; b++) {
                    const q8blk *xb = xq + b * ldq + 8 * k + j;
                    __m256i s0 = dot_u8s8(q[j], _mm256_loadu_si256((const __m256i *)xb[0].q));
                    __m256i s1 = dot_u8s8(q[j + 1], _mm256_loadu_si256((const __m256i *)xb[1].q));
                    acc[b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), _mm256_set1_ps(scl[j] * xb[0].d), acc[b]);
                    acc2[b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), _mm256_set1_ps(scl[j + 1] * xb[1].d), acc2[b]);
                    extra[b] -= mn[j] * xb[0].d * (float)xb[0].s + mn[j + 1] * xb[1].d * (float)xb[1].s;
                }
        }
        for (int b = 0; b < B; b++) y[b * ldy] = hsum8(_mm256_add_ps(acc[b], acc2[b])) + extra[b];
        return;
    }
    case T_Q6_K: {
        const __m256i c32 = _mm256_set1_epi8(32);
        __m256i q[8];
        for (int k = 0; k < nb / 8; k++, w += 210) {
            const int8_t *sc = (const int8_t *)(w + 192);
            float d = f16c_f32(rd16(w + 208));
            kq_unpack(t, w, q);
            for (int j = 0; j < 8; j++) {
                __m256i scv = _mm256_set_m128i(_mm_set1_epi16(sc[2 * j + 1]), _mm_set1_epi16(sc[2 * j]));
                for (int b = 0; b < B; b++) {
                    const q8blk *xb = xq + b * ldq + 8 * k + j;
                    __m256i xv = _mm256_loadu_si256((const __m256i *)xb->q);
                    __m256i p = _mm256_sub_epi16(_mm256_maddubs_epi16(q[j], xv), _mm256_maddubs_epi16(c32, xv));
                    acc[b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(p, scv)), _mm256_set1_ps(d * xb->d), acc[b]);
                }
            }
        }
        for (int b = 0; b < B; b++) y[b * ldy] = hsum8(acc[b]);
        return;
    }
    default:
        for (int b = 0; b < B; b++) y[b * ldy] = dot_fast_c(t, w, xq + b * ldq, nb);
    }
}

AVX2 static void dots_exact_avx2(int t, const uint8_t *w, const float *x, int64_t ldx, int n, int B, float *y, int64_t ldy) {
    for (int b = 0; b < B; b += TILE, x += TILE * ldx, y += TILE * ldy)
        switch (B - b < TILE ? B - b : TILE) {  /* constant counts: each case its own inlined copy */
        case 4: dots_exact_tile(t, w, x, ldx, n, 4, y, ldy); break;
        case 3: dots_exact_tile(t, w, x, ldx, n, 3, y, ldy); break;
        case 2: dots_exact_tile(t, w, x, ldx, n, 2, y, ldy); break;
        default: dots_exact_tile(t, w, x, ldx, n, 1, y, ldy);
        }
}

AVX2 static void dots_fast_avx2(int t, const uint8_t *w, const q8blk *xq, int64_t ldq, int nb, int B, float *y, int64_t ldy) {
    for (int b = 0; b < B; b += TILE, xq += TILE * ldq, y += TILE * ldy)
        switch (B - b < TILE ? B - b : TILE) {
        case 4: dots_fast_tile(t, w, xq, ldq, nb, 4, y, ldy); break;
        case 3: dots_fast_tile(t, w, xq, ldq, nb, 3, y, ldy); break;
        case 2: dots_fast_tile(t, w, xq, ldq, nb, 2, y, ldy); break;
        default: dots_fast_tile(t, w, xq, ldq, nb, 1, y, ldy);
        }
}

/* ---- fast mode with AVX-512 VNNI (vpdpbusd, EVEX) ---------------------------------------------
 * Another float order than the AVX2 kernels above (tested against them within tolerance only),
 * the same for one token and for any batch: the one-token dot IS the batch tile with B = 1, so a
 * token's result does not depend on its batch. Per (block, token): the integer dot in 8 int32
 * lanes (vpdpbusd, exact), the block's offset terms per lane without scalar code (Q4_1 and
 * Q4_K/Q5_K: the min times each lane's sum of x, a vpdpbusd of ones), one convert and one FMA
 * into the token's accumulator. Each token keeps even and odd blocks (sub-blocks of K blocks)
 * apart, so that one token is not bound by the FMA latency.
 * The steps, run rows x tokens times, read the activations repacked once per product
 * (vnni_pack): a block pair's values in one aligned 64-byte load, and for Q4_0, Q8_0 and Q6_K
 * as x + 128 (unsigned), times the weights signed: the offset that adds, -128 (sum of w) per
 * lane, comes from the weights alone, once per row block for all tokens (Q4_0's -8 then costs
 * no step work). The same integer sums, hence the same floats, as reading x itself. */
#define VNNI __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))
#define TILE_V 8

/* the f16 at p, exactly converted, in 8 lanes */
VNNI static inline __m256 f16x8(const uint8_t *p) {
    return _mm256_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(rd16(p))));
}

/* unsigned bytes u times signed bytes s, sums of 4 in 8 (16) int32 lanes */
VNNI static inline __m256i dpbusd(__m256i u, __m256i s) {
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
}
VNNI static INLINE __m512i dpbusd2(__m512i u, __m512i s) { return _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, s); }
VNNI static INLINE __m512i cat_i(__m256i lo, __m256i hi) { return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); }
VNNI static INLINE __m512 cat_f(__m256 lo, __m256 hi) { return _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1); }
/* cat_i(nibbles(p), nibbles(p + stride)) and cat_f(f16x8(p), f16x8(p + stride)): the same
 * bits in 5 and 6 instructions instead of 9 each (one token's Q4_0 row was compute-bound: a
 * core read 19 GB/s whether the rows came from DRAM or L3). The two 16-byte runs load into one
 * register, their high nibbles are one shift, and one permutation puts each block's low and
 * high halves side by side; the two scales convert together and spread over their 8 lanes.
 * Tiles of more than 4 tokens keep the old form: with these, 8 tokens' gate rows took 1.3
 * times as long (the permutations' index registers, measured, not understood further). */
VNNI static INLINE __m512i nibbles2(const uint8_t *p, int stride) {
    __m256i a = _mm256_loadu2_m128i((const __m128i *)(p + stride), (const __m128i *)p);
    __m512i z = _mm512_permutex2var_epi64(_mm512_castsi256_si512(a), _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0),
                                          _mm512_castsi256_si512(_mm256_srli_epi16(a, 4)));
    return _mm512_and_si512(z, _mm512_set1_epi8(15));
}
VNNI static INLINE __m512 f16x8x2(const uint8_t *p, int stride) {
    __m128 f = _mm_cvtph_ps(_mm_insert_epi16(_mm_cvtsi32_si128(rd16(p)), rd16(p + stride), 1));
    return _mm512_permutexvar_ps(_mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0), _mm512_castps128_ps512(f));
}
/* lanes 0..7 = v[j], lanes 8..15 = v[j + 1] */
VNNI static INLINE __m512 spread2(__m256 v, int j) {
    return _mm512_permutexvar_ps(_mm512_set_epi32(j + 1, j + 1, j + 1, j + 1, j + 1, j + 1, j + 1, j + 1, j, j, j, j, j, j, j, j),
                                 _mm512_castps256_ps512(v));
}
/* -128 (sum of the signed bytes w) per lane: what x + 128 adds to a dot with w */
VNNI static INLINE __m512i off128(__m512i w) { return _mm512_sub_epi32(_mm512_setzero_si512(), dpbusd2(_mm512_set1_epi8((char)0x80), w)); }
VNNI static INLINE __m256i off128_1(__m256i w) { return _mm256_sub_epi32(_mm256_setzero_si256(), dpbusd(_mm256_set1_epi8((char)0x80), w)); }

/* One token's Q4_0 products take the nibbles unsigned and x signed, with -8 (sum of x) per lane
 * packed beside x (vnni_pack): two instructions less per row block pair than x + 128 times
 * the signed nibbles, which a batch keeps (its per-token loads outweigh it: 8 tokens 37 %
 * slower). Both give the same integer per lane, so a token's floats do not depend on its batch. */
static inline int q4_0_alone(int t, int B) { return t == T_Q4_0 && B == 1; }
static inline int xp_unsigned(int t, int B) { return t == T_Q8_0 || t == T_Q6_K || (t == T_Q4_0 && B > 1); }
/* a token's share of the packed buffer, in pairs: np pairs of values, then their 2 np scales;
 * one token's Q4_0 offset terms follow it (np pairs more: xp_size) */
static inline int64_t xp_ld(int nb) { int64_t np = (nb + 1) / 2; return np + (np * 8 + 63) / 64; }
static inline int64_t xp_size(int nb, int B) { return B * xp_ld(nb) + (B == 1 ? (nb + 1) / 2 : 0); }

/* Per token: np = ceil(nb / 2) pairs of blocks (2i, 2i+1; an odd last block with zeros above),
 * x + 128 where xp_unsigned; for one token's Q4_0 then, per pair, -8 (sum of x) of each int32
 * lane (the 4 values a lane of vpdpbusd sums: with the nibbles u unsigned, sum (u - 8) x per
 * lane is vpdpbusd(that, u, x)); then the pairs' scales (d_2i, d_2i+1). */
VNNI static void vnni_pack(int t, const q8blk *xq, int64_t ldq, int nb, int B, xpair *out) {
    int64_t np = (nb + 1) / 2, ld = xp_ld(nb);
    __m512i flip = _mm512_set1_epi8(xp_unsigned(t, B) ? (char)0x80 : 0);
    for (int b = 0; b < B; b++, out += ld) {
        float *d = (float *)(out + np);
        for (int k = 0; k < nb; k += 2) {
            const q8blk *x = xq + b * ldq + k;
            int two = k + 1 < nb;
            __m512i xv = cat_i(_mm256_loadu_si256((const __m256i *)x[0].q),
                               two ? _mm256_loadu_si256((const __m256i *)x[1].q) : _mm256_setzero_si256());
            _mm512_store_si512(out[k / 2].q, _mm512_xor_si512(xv, flip));
            if (q4_0_alone(t, B))
                _mm512_store_si512(out[ld + k / 2].q,
                                   _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(dpbusd2(_mm512_set1_epi8(1), xv), 3)));
            d[k] = x[0].d;
            d[k + 1] = two ? x[1].d : 0.f;
        }
    }
}

/* a pair's 64 bytes; its scales d, d[1] in the low / high 8 lanes; the low halves (odd last block) */
#define XV2(p) _mm512_load_si512((p)->q)
#define XV1(p) _mm256_load_si256((const __m256i *)(p)->q)
VNNI static INLINE __m512 xd2(const float *d) {
    return _mm512_permutexvar_ps(_mm512_mask_set1_epi32(_mm512_setzero_si512(), 0xff00, 1),
                                 _mm512_castps128_ps512(_mm_castpd_ps(_mm_load_sd((const double *)d))));
}

/* One (block, token) step of each type into the token's accumulator a (an odd last block, low
 * 8 lanes); q: the weights signed, c = off128(q) for x + 128 */
VNNI static INLINE __m256 q4_0_step(__m256i q, __m256i c, __m256 d, const xpair *x, const float *xd, __m256 a) {
    __m256i s = _mm256_dpbusd_epi32(c, XV1(x), q);  /* sum (q - 8) x (Q8_0: sum q x) */
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(d, _mm256_set1_ps(*xd)), a);
}
/* Q4_0: nibbles u unsigned times x signed, plus the token's offset terms o (vnni_pack) */
VNNI static INLINE __m256 q4_0u_step(__m256i u, __m256 d, const xpair *x, const float *xd, const xpair *o, __m256 a) {
    __m256i s = _mm256_dpbusd_epi32(XV1(o), u, XV1(x));  /* sum (u - 8) x */
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(d, _mm256_set1_ps(*xd)), a);
}
VNNI static INLINE __m256 q4_1_step(__m256i u, __m256 d, __m256 m, const xpair *x, const float *xd, __m256 a) {
    __m256i xv = XV1(x);  /* d sum q x + m sum x, per lane */
    __m256 v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dpbusd(u, xv)), d, _mm256_mul_ps(m, _mm256_cvtepi32_ps(dpbusd(_mm256_set1_epi8(1), xv))));
    return _mm256_fmadd_ps(v, _mm256_set1_ps(*xd), a);
}
/* Q8_0 and Q4_0 (their q - 8) have the same step */
#define q8_0_step q4_0_step

/* The same on two consecutive blocks (or K sub-blocks) at once, block k in the low 8 lanes and
 * k+1 in the high 8 of a 512-bit register: lane for lane the float operations of two 256-bit
 * steps into an even and an odd accumulator (bit-identical), in fewer instructions. */
VNNI static INLINE __m512 q4_0_step2(__m512i q, __m512i c, __m512 d, const xpair *x, const float *xd, __m512 a) {
    __m512i s = _mm512_dpbusd_epi32(c, XV2(x), q);
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d, xd2(xd)), a);
}
#define q8_0_step2 q4_0_step2
VNNI static INLINE __m512 q4_0u_step2(__m512i u, __m512 d, const xpair *x, const float *xd, const xpair *o, __m512 a) {
    __m512i s = _mm512_dpbusd_epi32(XV2(o), u, XV2(x));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d, xd2(xd)), a);
}
VNNI static INLINE __m512 q4_1_step2(__m512i u, __m512 d, __m512 m, const xpair *x, const float *xd, __m512 a) {
    __m512i xv = XV2(x);  /* the min times each lane's sum of x */
    __m512 mx = _mm512_mul_ps(m, _mm512_cvtepi32_ps(dpbusd2(_mm512_set1_epi8(1), xv)));
    return _mm512_fmadd_ps(_mm512_fmadd_ps(_mm512_cvtepi32_ps(dpbusd2(u, xv)), d, mx), xd2(xd), a);
}
VNNI static INLINE __m512 k45_step2(__m512i q, __m512 sc, __m512 m, const xpair *x, const float *xd, __m512 a) {
    __m512i xv = XV2(x);
    __m512 mx = _mm512_mul_ps(m, _mm512_cvtepi32_ps(dpbusd2(_mm512_set1_epi8(1), xv)));
    return _mm512_fmadd_ps(_mm512_fmsub_ps(_mm512_cvtepi32_ps(dpbusd2(q, xv)), sc, mx), xd2(xd), a);
}
/* Q6_K: q - 32 signed; pairs of (x + 128)(q - 32) in int16, less c = 128 (sum of the pair's
 * q - 32) (|.| <= 255 * 32 * 2), then times each half's scale */
VNNI static INLINE __m512 q6_k_step2(__m512i q, __m512i c, __m512i scv, __m512 d, const xpair *x, const float *xd, __m512 a) {
    __m512i p = _mm512_sub_epi16(_mm512_maddubs_epi16(XV2(x), q), c);
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_madd_epi16(p, scv)), _mm512_mul_ps(d, xd2(xd)), a);
}

/* Per token one accumulator of 16 lanes: blocks in pairs, the even one in the low 8 lanes, the
 * odd one in the high 8; an odd last block goes to the low 8 (256-bit step). The result: the
 * sum of the 16 lanes as hsum8(low + high). xp: B tokens packed (vnni_pack). */
VNNI static INLINE void dots_fast_vnni_tile(int t, const uint8_t *w, const xpair *xp, int nb, int B, int alone, float *y,
                                            int64_t ldy) {
    __m512 acc[TILE_V];
    int64_t ld = xp_ld(nb), np = (nb + 1) / 2;
    for (int b = 0; b < B; b++) acc[b] = _mm512_setzero_ps();
#define XP(b, k) (xp + (b) * ld + (k) / 2), ((const float *)(xp + (b) * ld + np) + (k))  /* values, scales */
#define XO(b, k) (xp + ld + (k) / 2)  /* one token's Q4_0 offset terms */
#define LOW(b, step) acc[b] = _mm512_insertf32x8(acc[b], step, 0)  /* the low 8 lanes of acc[b] = step */
#define LO(b) _mm512_castps512_ps256(acc[b])
    int k = 0;
    switch (t) {
    case T_Q4_0:
        if (!alone) {  /* c = off128(q) in one: 4096 - 128 (sum of the nibbles u) */
            for (; k + 1 < nb; k += 2, w += 36) {
                __m512i u = B > 4 ? cat_i(nibbles(w + 2), nibbles(w + 20)) : nibbles2(w + 2, 18);
                __m512i q = _mm512_sub_epi8(u, _mm512_set1_epi8(8));
                __m512i c = _mm512_dpbusd_epi32(_mm512_set1_epi32(4096), u, _mm512_set1_epi8((char)0x80));
                __m512 d = B > 4 ? cat_f(f16x8(w), f16x8(w + 18)) : f16x8x2(w, 18);
                for (int b = 0; b < B; b++) acc[b] = q4_0_step2(q, c, d, XP(b, k), acc[b]);
            }
            if (k < nb) {
                __m256i q0 = _mm256_sub_epi8(nibbles(w + 2), _mm256_set1_epi8(8)), c0 = off128_1(q0);
                __m256 d0 = f16x8(w);
                for (int b = 0; b < B; b++) LOW(b, q4_0_step(q0, c0, d0, XP(b, k), LO(b)));
            }
            break;
        }
        for (; k + 1 < nb; k += 2, w += 36) {  /* one token: the -8 is in its offset terms */
            __m512i u = nibbles2(w + 2, 18);
            __m512 d = f16x8x2(w, 18);
            for (int b = 0; b < B; b++) acc[b] = q4_0u_step2(u, d, XP(b, k), XO(b, k), acc[b]);
        }
        if (k < nb) {
            __m256i u0 = nibbles(w + 2);
            __m256 d0 = f16x8(w);
            for (int b = 0; b < B; b++) LOW(b, q4_0u_step(u0, d0, XP(b, k), XO(b, k), LO(b)));
        }
        break;
    case T_Q4_1:
        for (; k + 1 < nb; k += 2, w += 40) {
            __m512i u = B > 4 ? cat_i(nibbles(w + 4), nibbles(w + 24)) : nibbles2(w + 4, 20);
            __m512 d = B > 4 ? cat_f(f16x8(w), f16x8(w + 20)) : f16x8x2(w, 20);
            __m512 m = B > 4 ? cat_f(f16x8(w + 2), f16x8(w + 22)) : f16x8x2(w + 2, 20);
            for (int b = 0; b < B; b++) acc[b] = q4_1_step2(u, d, m, XP(b, k), acc[b]);
        }
        if (k < nb) {
            __m256i u0 = nibbles(w + 4);
            __m256 d0 = f16x8(w), m0 = f16x8(w + 2);
            for (int b = 0; b < B; b++) LOW(b, q4_1_step(u0, d0, m0, XP(b, k), LO(b)));
        }
        break;
    case T_Q8_0:
        for (; k + 1 < nb; k += 2, w += 68) {
            __m512i q = cat_i(_mm256_loadu_si256((const __m256i *)(w + 2)), _mm256_loadu_si256((const __m256i *)(w + 36))), c = off128(q);
            __m512 d = B > 4 ? cat_f(f16x8(w), f16x8(w + 34)) : f16x8x2(w, 34);
            for (int b = 0; b < B; b++) acc[b] = q8_0_step2(q, c, d, XP(b, k), acc[b]);
        }
        if (k < nb) {
            __m256i q0 = _mm256_loadu_si256((const __m256i *)(w + 2)), c0 = off128_1(q0);
            __m256 d0 = f16x8(w);
            for (int b = 0; b < B; b++) LOW(b, q8_0_step(q0, c0, d0, XP(b, k), LO(b)));
        }
        break;
    case T_Q4_K: case T_Q5_K: {  /* sub-blocks 2i in the low lanes, 2i+1 in the high */
        __m256 scl, mn;
        __m256i q[8];
        for (; k < nb / 8; k++, w += type_bytes(t)) {
            k45_scales_vec(w, &scl, &mn);
            kq_unpack(t, w, q);
            for (int j = 0; j < 8; j += 2) {
                __m512i qq = cat_i(q[j], q[j + 1]);
                __m512 sc = spread2(scl, j), m = spread2(mn, j);
                for (int b = 0; b < B; b++) acc[b] = k45_step2(qq, sc, m, XP(b, 8 * k + j), acc[b]);
            }
        }
        break;
    }
    case T_Q6_K: {
        const __m512i c32 = _mm512_set1_epi8(32);
        __m256i q[8];
        for (; k < nb / 8; k++, w += 210) {
            const int8_t *sc = (const int8_t *)(w + 192);
            __m256 d8 = f16x8(w + 208);
            __m512 d = cat_f(d8, d8);
            kq_unpack(t, w, q);
            for (int j = 0; j < 8; j += 2) {
                __m512i qq = _mm512_sub_epi8(cat_i(q[j], q[j + 1]), c32);
                __m512i c = _mm512_maddubs_epi16(_mm512_set1_epi8((char)0x80), qq);
                __m512i scv = cat_i(_mm256_set_m128i(_mm_set1_epi16(sc[2 * j + 1]), _mm_set1_epi16(sc[2 * j])),
                                    _mm256_set_m128i(_mm_set1_epi16(sc[2 * j + 3]), _mm_set1_epi16(sc[2 * j + 2])));
                for (int b = 0; b < B; b++) acc[b] = q6_k_step2(qq, c, scv, d, XP(b, 8 * k + j), acc[b]);
            }
        }
        break;
    }
    }
#undef XP
#undef XO
#undef LOW
#undef LO
    for (int b = 0; b < B; b++) y[b * ldy] = hsum8(_mm256_add_ps(_mm512_castps512_ps256(acc[b]), _mm512_extractf32x8_ps(acc[b], 1)));
}

VNNI static float dot_fast_vnni(int t, const uint8_t *w, const xpair *xp, int nb) {
    float y;
    dots_fast_vnni_tile(t, w, xp, nb, 1, 1, &y, 0);
    return y;
}

/* alone: xp is one token's pack (vnni_pack with B = 1), not a tile of a batch's */
VNNI static void dots_fast_vnni(int t, const uint8_t *w, const xpair *xp, int nb, int B, int alone, float *y,
                                int64_t ldy) {
    for (int b = 0; b < B; b += TILE_V, xp += TILE_V * xp_ld(nb), y += TILE_V * ldy)
        switch (B - b < TILE_V ? B - b : TILE_V) {  /* constant counts: each case its own inlined copy */
        case 8: dots_fast_vnni_tile(t, w, xp, nb, 8, 0, y, ldy); break;
        case 7: dots_fast_vnni_tile(t, w, xp, nb, 7, 0, y, ldy); break;
        case 6: dots_fast_vnni_tile(t, w, xp, nb, 6, 0, y, ldy); break;
        case 5: dots_fast_vnni_tile(t, w, xp, nb, 5, 0, y, ldy); break;
        case 4: dots_fast_vnni_tile(t, w, xp, nb, 4, 0, y, ldy); break;
        case 3: dots_fast_vnni_tile(t, w, xp, nb, 3, 0, y, ldy); break;
        case 2: dots_fast_vnni_tile(t, w, xp, nb, 2, 0, y, ldy); break;
        default: dots_fast_vnni_tile(t, w, xp, nb, 1, alone, y, ldy);
        }
}

/* Fast mode on interleaved rows (X16, see interleave): a 512-bit register holds 4 nibble bytes
 * of each of 16 rows, so per token and block 8 vpdpbusd against x's matching 4 bytes
 * (broadcast) give 16 rows' integer sums, and one conversion, one scale product and one
 * accumulation serve all 16 rows. A token then costs about 12 vector operations per 512
 * weights, against 32 on the file's own layout (4 per block pair of one row): what a batch
 * cannot share there (the README's Native kernels). Each lane's floats are the portable
 * x16_rows_c's, in the same order, so a token gets the same result alone or in any batch and
 * on either path. */
/* Blocks ahead each block asks the caches for (a group's blocks follow each other): a batch's
 * tiles compute long enough per block that the hardware prefetchers fell behind (the 1.1B
 * shape in lockstep: 4 tokens 33-36 -> 27-30 ms a step, 8 tokens 61-65 -> 42-46 ms; one
 * token unchanged). */
#define X16_AHEAD 8
/* The value bytes of a run of L lanes at v (interleave_run's layout; L < 16, an R16 row's last
 * run: masked loads, lanes past L zero) as unsigned values: u[i] holds values 4i..4i+3 of
 * every lane (Q4: low nibbles in u[0..3], high ones in u[4..7]). X16's tiles and R16's runs. */
VNNI static INLINE void run_values(int q8, const uint8_t *v, int L, __m512i *u) {
    const __m512i m4 = _mm512_set1_epi8(15);
    const __mmask64 mv = L == 16 ? ~0ULL : (1ULL << (4 * L)) - 1;
    for (int j = 0; j < (q8 ? 8 : 4); j++) {
        __m512i z = L == 16 ? _mm512_loadu_si512(v + 64 * j) : _mm512_maskz_loadu_epi8(mv, v + 4 * L * j);
        if (q8) { u[j] = z; continue; }
        u[j] = _mm512_and_si512(z, m4);
        u[4 + j] = _mm512_and_si512(_mm512_srli_epi16(z, 4), m4);
    }
}
VNNI static INLINE void x16_tile_vnni(int t, const uint8_t *g, int nb, const q8blk *xq, int64_t ldq, int B,
                                      float *y, int64_t ldy, int nvalid) {
    __m512 acc[TILE_V];
    const int gb = 16 * type_bytes(t - X16), q41 = t == X16 + T_Q4_1, q8 = t == X16 + T_Q8_0;
    for (int b = 0; b < B; b++) acc[b] = _mm512_setzero_ps();
    for (int k = 0; k < nb; k++, g += gb) {
        for (int o = 0; o < gb; o += 64) _mm_prefetch((const char *)g + X16_AHEAD * gb + o, _MM_HINT_T0);
        __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)g));
        __m512 m = q41 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(g + 32))) : d;
        __m512i u[8];  /* u[i]: values 4i..4i+3 of the 16 rows, unsigned */
        run_values(q8, g + run_head(t - X16, 16), 16, u);
        for (int b = 0; b < B; b++) {
            const q8blk *x = xq + b * ldq + k;
            __m512i s = _mm512_set1_epi32(x16_offset(t, x->s)), s2 = _mm512_setzero_si512();
            for (int j = 0; j < 8; j += 2) {  /* two chains: a token alone waits on vpdpbusd's latency */
                s = _mm512_dpbusd_epi32(s, u[j], _mm512_set1_epi32(rd32(x->q + 4 * j)));
                s2 = _mm512_dpbusd_epi32(s2, u[j + 1], _mm512_set1_epi32(rd32(x->q + 4 * j + 4)));
            }
            __m512 f = _mm512_cvtepi32_ps(_mm512_add_epi32(s, s2));
            if (q41)  /* d sum u x + m sum x, times x's scale */
                acc[b] = _mm512_fmadd_ps(_mm512_fmadd_ps(f, d, _mm512_mul_ps(m, _mm512_set1_ps((float)x->s))),
                                         _mm512_set1_ps(x->d), acc[b]);
            else
                acc[b] = _mm512_fmadd_ps(f, _mm512_mul_ps(d, _mm512_set1_ps(x->d)), acc[b]);
        }
    }
    __mmask16 keep = nvalid >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << nvalid) - 1);
    for (int b = 0; b < B; b++) _mm512_mask_storeu_ps(y + b * ldy, keep, acc[b]);
}

/* Q6_K on interleaved rows (layout: interleave): per 256-value block the 16 rows' scales
 * widened once, then per activation block (two 16-value sub-blocks) the 6-bit values of 16 rows
 * unpacked once for every token: per token 8 vpdpbusd, the sub-blocks' -32 offsets (hs: each
 * token's sums of x over 16 values) in the accumulators' start, their int8 scales as two
 * 32-bit products, one conversion and one scaled accumulation. */
VNNI static INLINE void x16_tile_q6k_vnni(const uint8_t *g, int nb, const q8blk *xq, int64_t ldq, const int32_t *hs,
                                          int64_t ldh, int B, float *y, int64_t ldy, int nvalid) {
    __m512 acc[TILE_V];
    const __m512i m4 = _mm512_set1_epi8(15), m30 = _mm512_set1_epi8(0x30);
    for (int b = 0; b < B; b++) acc[b] = _mm512_setzero_ps();
    for (int k = 0; k < nb; k++, g += 16 * 210) {
        for (int o = 0; o < 16 * 210; o += 64) _mm_prefetch((const char *)g + 2 * 16 * 210 + o, _MM_HINT_T0);
        __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)g));
        for (int xb = 0; xb < 8; xb++) {  /* activation block xb: sub-blocks 2 xb, 2 xb + 1 */
            __m512i u[8], sc[2];
            for (int h = 0; h < 2; h++) {
                int n = 2 * xb + h;
                __m512i l0 = _mm512_loadu_si512(g + Q6_L(2 * n)), l1 = _mm512_loadu_si512(g + Q6_L(2 * n + 1));
                __m512i hh = _mm512_loadu_si512(g + Q6_H(n));
                u[4 * h + 0] = _mm512_or_si512(_mm512_and_si512(l0, m4), _mm512_and_si512(_mm512_slli_epi16(hh, 4), m30));
                u[4 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l0, 4), m4),
                                               _mm512_and_si512(_mm512_slli_epi16(hh, 2), m30));
                u[4 * h + 2] = _mm512_or_si512(_mm512_and_si512(l1, m4), _mm512_and_si512(hh, m30));
                u[4 * h + 3] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l1, 4), m4),
                                               _mm512_and_si512(_mm512_srli_epi16(hh, 2), m30));
                sc[h] = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(g + Q6_SC(n))));
            }
            for (int b = 0; b < B; b++) {
                const q8blk *x = xq + b * ldq + 8 * k + xb;
                const int32_t *hb = hs + b * ldh + 2 * (8 * k + xb);
                __m512i sa = _mm512_set1_epi32(-32 * hb[0]), sb = _mm512_set1_epi32(-32 * hb[1]);
                for (int j = 0; j < 4; j++) {
                    sa = _mm512_dpbusd_epi32(sa, u[j], _mm512_set1_epi32(rd32(x->q + 4 * j)));
                    sb = _mm512_dpbusd_epi32(sb, u[4 + j], _mm512_set1_epi32(rd32(x->q + 16 + 4 * j)));
                }
                __m512i si = _mm512_add_epi32(_mm512_mullo_epi32(sa, sc[0]), _mm512_mullo_epi32(sb, sc[1]));
                acc[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(si), _mm512_mul_ps(d, _mm512_set1_ps(x->d)), acc[b]);
            }
        }
    }
    __mmask16 keep = nvalid >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << nvalid) - 1);
    for (int b = 0; b < B; b++) _mm512_mask_storeu_ps(y + b * ldy, keep, acc[b]);
}

/* Q4_K on interleaved rows (layout: interleave_q4k): per sub-block of 32 values (one
 * activation block) the 16 rows' d sc and dmin m as float vectors, shared by every token; per
 * token 8 vpdpbusd and the Q4_1-like float steps: (d sc) sum q x - (dmin m) sum x, times x's
 * scale. */
VNNI static INLINE void x16_tile_q4k_vnni(const uint8_t *g, int nb, const q8blk *xq, int64_t ldq, int B, float *y,
                                          int64_t ldy, int nvalid) {
    __m512 acc[TILE_V];
    const __m512i m4 = _mm512_set1_epi8(15);
    for (int b = 0; b < B; b++) acc[b] = _mm512_setzero_ps();
    for (int k = 0; k < nb; k++, g += 2368) {
        for (int o = 0; o < 2368; o += 64) _mm_prefetch((const char *)g + 2 * 2368 + o, _MM_HINT_T0);
        __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)g));
        __m512 dm = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(g + 32)));
        for (int p = 0; p < 4; p++) {  /* sub-blocks 2p (low nibbles) and 2p + 1 (high) */
            __m512i u[2][8];
            for (int j = 0; j < 8; j++) {
                __m512i z = _mm512_loadu_si512(g + Q4K_V(p) + 64 * j);
                u[0][j] = _mm512_and_si512(z, m4);
                u[1][j] = _mm512_and_si512(_mm512_srli_epi16(z, 4), m4);
            }
            for (int h = 0; h < 2; h++) {
                int sb = 2 * p + h;
                __m512 dsc = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                                  _mm_loadu_si128((const __m128i *)(g + Q4K_SC(sb))))));
                __m512 dmm = _mm512_mul_ps(dm, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                                   _mm_loadu_si128((const __m128i *)(g + Q4K_MN(sb))))));
                for (int b = 0; b < B; b++) {
                    const q8blk *x = xq + b * ldq + 8 * k + sb;
                    __m512i s = _mm512_setzero_si512(), s2 = _mm512_setzero_si512();
                    for (int j = 0; j < 8; j += 2) {
                        s = _mm512_dpbusd_epi32(s, u[h][j], _mm512_set1_epi32(rd32(x->q + 4 * j)));
                        s2 = _mm512_dpbusd_epi32(s2, u[h][j + 1], _mm512_set1_epi32(rd32(x->q + 4 * j + 4)));
                    }
                    __m512 v = _mm512_fmsub_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s, s2)), dsc,
                                               _mm512_mul_ps(dmm, _mm512_set1_ps((float)x->s)));
                    acc[b] = _mm512_fmadd_ps(v, _mm512_set1_ps(x->d), acc[b]);
                }
            }
        }
    }
    __mmask16 keep = nvalid >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << nvalid) - 1);
    for (int b = 0; b < B; b++) _mm512_mask_storeu_ps(y + b * ldy, keep, acc[b]);
}

/* one tile of nt tokens with the type and the count constant: each (type, count) its own
 * inlined copy; CALL(n) is the tile function's call for n tokens */
#define BY_TILE(CALL)                                                                   \
    switch (nt) {                                                                       \
    case 8: CALL(8); break;                                                             \
    case 7: CALL(7); break;                                                             \
    case 6: CALL(6); break;                                                             \
    case 5: CALL(5); break;                                                             \
    case 4: CALL(4); break;                                                             \
    case 3: CALL(3); break;                                                             \
    case 2: CALL(2); break;                                                             \
    default: CALL(1);                                                                   \
    }
#define Q4_0_TILE(n) x16_tile_vnni(X16 + T_Q4_0, g, nb, xb, ldq, n, yb, ldy, nv)
#define Q4_1_TILE(n) x16_tile_vnni(X16 + T_Q4_1, g, nb, xb, ldq, n, yb, ldy, nv)
#define Q8_0_TILE(n) x16_tile_vnni(X16 + T_Q8_0, g, nb, xb, ldq, n, yb, ldy, nv)
#define Q4_K_TILE(n) x16_tile_q4k_vnni(g, nb, xb, ldq, n, yb, ldy, nv)
#define Q6_K_TILE(n) x16_tile_q6k_vnni(g, nb, xb, ldq, hs + b * ldh, ldh, n, yb, ldy, nv)

/* nb: blocks of the type per row (of 32 values, of 256 for Q6_K); hs: Q6_K's sums of x over
 * each 16 values, ldh per token */
VNNI static void x16_rows_vnni(int t, const uint8_t *g, int64_t gstride, int64_t n_rows, int nb, const q8blk *xq,
                               int64_t ldq, const int32_t *hs, int64_t ldh, int B, float *y, int64_t ldy) {
    for (int64_t r = 0; r < n_rows; r += 16, g += gstride) {
        int nv = n_rows - r < 16 ? (int)(n_rows - r) : 16;
        for (int b = 0; b < B; b += TILE_V) {
            const q8blk *xb = xq + b * ldq;
            float *yb = y + b * ldy + r;
            int nt = B - b < TILE_V ? B - b : TILE_V;
            if (t == X16 + T_Q6_K) BY_TILE(Q6_K_TILE)
            else if (t == X16 + T_Q4_K) BY_TILE(Q4_K_TILE)
            else if (t == X16 + T_Q4_0) BY_TILE(Q4_0_TILE)
            else if (t == X16 + T_Q4_1) BY_TILE(Q4_1_TILE)
            else BY_TILE(Q8_0_TILE)
        }
    }
}
#undef BY_TILE
#undef Q4_0_TILE
#undef Q4_1_TILE
#undef Q8_0_TILE
#undef Q4_K_TILE
#undef Q6_K_TILE

/* Fast mode on R16 rows (rows picked by activity: threshold steps' up rows, predictors' gate and
 * up rows). On the file's layout a row's block pair costs about 16 vector operations (the
 * nibbles and two scales put in place per pair, one accumulation per 64 values); here 16 blocks
 * (512 values) cost about 27: 8 vpdpbusd against x's values packed to match (r16_pack), and one
 * conversion, one scale product and one accumulation for all 16 blocks. */
/* per token and run of 16 blocks (a row's last run: lanes past its blocks zero): 8 runs of x's
 * values (run j, lane k: values 4j..4j+3 of block k), then per block the offset of its integer
 * sum (Q4_1: the float sum of x), then x's scales */
static inline int64_t r16_ld(int nb) { return 10 * (int64_t)((nb + 15) / 16); }
static void r16_pack(int t, const q8blk *xq, int64_t ldq, int nb, int B, xpair *out) {
    int xt = t - R16 + X16, q41 = t == R16 + T_Q4_1;
    for (int b = 0; b < B; b++, out += r16_ld(nb))
        for (int c = 0; c < nb; c += 16) {
            xpair *o = out + 10 * (c / 16);
            if (nb - c < 16) memset(o, 0, sizeof(xpair) * 10);  /* a short last run: its missing lanes add 0 */
            const q8blk *x = xq + b * ldq + c;
            for (int k = 0; k < 16 && c + k < nb; k++) {
                for (int j = 0; j < 8; j++) memcpy(o[j].q + 4 * k, x[k].q + 4 * j, 4);
                int32_t off = x16_offset(xt, x[k].s);
                float sum = (float)x[k].s;
                memcpy(o[8].q + 4 * k, q41 ? (const void *)&sum : (const void *)&off, 4);
                memcpy(o[9].q + 4 * k, &x[k].d, 4);
            }
        }
}

/* the 16 lanes' sum in hsum8's order after adding the high 8 lanes to the low (r16_dot_c) */
VNNI static INLINE float hsum16(__m512 v) {
    return hsum8(_mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)));
}

/* One run of L blocks of an R16 row (at w) times x's matching pack entries, into acc; lanes
 * past L load zeros (their scales too), so they add 0 */
VNNI static INLINE __m512 r16_run(const int t, const uint8_t *w, const int L, const xpair *x, __m512 acc) {
    const int q41 = t == R16 + T_Q4_1, q8 = t == R16 + T_Q8_0;
    const __mmask16 ms = (__mmask16)((1u << L) - 1);
    __m512i u[8];
    run_values(q8, w + run_head(t - R16, L), L, u);
    /* two chains: a row waits on vpdpbusd's latency, not its throughput */
    __m512i s0 = q41 ? _mm512_setzero_si512() : _mm512_load_si512(x[8].q), s1 = _mm512_setzero_si512();
    for (int j = 0; j < 4; j++) {
        s0 = _mm512_dpbusd_epi32(s0, u[j], _mm512_load_si512(x[j].q));
        s1 = _mm512_dpbusd_epi32(s1, u[4 + j], _mm512_load_si512(x[4 + j].q));
    }
    __m512 f = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)), xd = _mm512_load_ps((const float *)x[9].q);
    __m512 d = _mm512_cvtph_ps(L == 16 ? _mm256_loadu_si256((const __m256i *)w) : _mm256_maskz_loadu_epi16(ms, w));
    if (q41) {
        const uint8_t *mp = w + 2 * L;
        __m512 m = _mm512_cvtph_ps(L == 16 ? _mm256_loadu_si256((const __m256i *)mp) : _mm256_maskz_loadu_epi16(ms, mp));
        return _mm512_fmadd_ps(_mm512_fmadd_ps(f, d, _mm512_mul_ps(m, _mm512_load_ps((const float *)x[8].q))), xd, acc);
    }
    return _mm512_fmadd_ps(f, _mm512_mul_ps(d, xd), acc);
}

/* one R16 row (nb blocks) times one token packed by r16_pack, into acc: its full runs, then
 * its last run of nb % 16 blocks */
VNNI static INLINE __m512 r16_row(const int t, const uint8_t *w, int nb, const xpair *x, __m512 acc) {
    const int gb = 16 * type_bytes(t);
    int c = 0;
    for (; c + 16 <= nb; c += 16, w += gb, x += 10) acc = r16_run(t, w, 16, x, acc);
    return c < nb ? r16_run(t, w, nb - c, x, acc) : acc;
}

/* y (n floats) += a * one Q4_0 row: per block pair the nibbles in place (nibbles2), less 8,
 * widened and converted 16 at a time, each added to y in one fused multiply-add with the
 * block's a d (the AVX2 axpy takes about twice the instructions: one-row loops were
 * compute-bound on PowerInfer's down_t rows) */
VNNI static void axpy_q4_0_vnni(const uint8_t *w, float a, float *y, int n) {
    int nb = n / QK, k = 0;
    for (; k + 1 < nb; k += 2, w += 36, y += 64) {
        __m512i q = _mm512_sub_epi8(nibbles2(w + 2, 18), _mm512_set1_epi8(8));
        __m512 s0 = _mm512_set1_ps(a * _cvtsh_ss(rd16(w))), s1 = _mm512_set1_ps(a * _cvtsh_ss(rd16(w + 18)));
        __m512 v[4] = {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(q, 0))),
                       _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(q, 1))),
                       _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(q, 2))),
                       _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(q, 3)))};
        for (int j = 0; j < 4; j++)
            _mm512_storeu_ps(y + 16 * j, _mm512_fmadd_ps(v[j], j < 2 ? s0 : s1, _mm512_loadu_ps(y + 16 * j)));
    }
    if (k < nb) {  /* an odd last block */
        __m256i q = _mm256_sub_epi8(nibbles(w + 2), _mm256_set1_epi8(8));
        __m512 s0 = _mm512_set1_ps(a * _cvtsh_ss(rd16(w)));
        for (int j = 0; j < 2; j++)
            _mm512_storeu_ps(y + 16 * j, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                                              j ? _mm256_extracti128_si256(q, 1) : _mm256_castsi256_si128(q))),
                                                          s0, _mm512_loadu_ps(y + 16 * j)));
    }
}

VNNI static float r16_dot_vnni(int t, const uint8_t *w, const xpair *x, int nb) {
    __m512 z = _mm512_setzero_ps();
    return hsum16(t == R16 + T_Q4_0 ? r16_row(R16 + T_Q4_0, w, nb, x, z)
                  : t == R16 + T_Q4_1 ? r16_row(R16 + T_Q4_1, w, nb, x, z) : r16_row(R16 + T_Q8_0, w, nb, x, z));
}

#endif

static int use_avx2 = 0;
static int use_vnni = 0;  /* fast mode's integer dots with AVX-512 VNNI (implies use_avx2) */

#if HAVE_X86
/* quantize_q8 eight floats at a time, the same values: |x| max is exact, d and 1 / d are the
 * same scalar operations, x * id the same product, and the conversion rounds to nearest even
 * as lrintf does in the default rounding mode. */
AVX2 static void quantize_q8_avx2(const float *x, int n, q8blk *out) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    for (int b = 0; b < n / QK; b++) {
        const float *xb = x + b * QK;
        __m256 v[4], m = _mm256_setzero_ps();
        for (int u = 0; u < 4; u++) v[u] = _mm256_loadu_ps(xb + 8 * u), m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[u]));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        float amax = _mm_cvtss_f32(h);
        float d = amax / 127.f, id = d > 0 ? 1.f / d : 0.f;
        __m256 vid = _mm256_set1_ps(id);
        __m256i q[4];
        for (int u = 0; u < 4; u++) q[u] = _mm256_cvtps_epi32(_mm256_mul_ps(v[u], vid));
        __m256i s32 = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s32), _mm256_extracti128_si256(s32, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
        /* int32 -> int8 in order: packs interleave the 128-bit lanes, the permute undoes it */
        __m256i p16 = _mm256_packs_epi32(q[0], q[1]), p16b = _mm256_packs_epi32(q[2], q[3]);
        __m256i p8 = _mm256_packs_epi16(p16, p16b);
        p8 = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)out[b].q, p8);
        out[b].d = d;
        out[b].s = _mm_cvtsi128_si32(s4);
    }
}
#endif

static void quantize_q8(const float *x, int n, q8blk *out) {
#if HAVE_X86
    if (use_avx2) { quantize_q8_avx2(x, n, out); return; }
#endif
    quantize_q8_c(x, n, out);
}

static inline void axpy(int t, const uint8_t *w, float a, float *y, int n) {
#if HAVE_X86
    if (use_avx2) { axpy_avx2(t, w, a, y, n); return; }
#endif
    axpy_c(t, w, a, y, n);
}

/* Fast mode's axpy (down_t rows of an active neuron): Q4_0 on VNNI CPUs in 512-bit steps,
 * (a d) (q - 8) added to y with one rounding; exact mode keeps axpy's arithmetic. */
static void axpy_q4_0_vnni(const uint8_t *w, float a, float *y, int n);
static inline void axpy_any(int t, const uint8_t *w, float a, float *y, int n, int fast) {
#if HAVE_X86
    if (fast && use_vnni && t == T_Q4_0) { axpy_q4_0_vnni(w, a, y, n); return; }
#endif
    axpy(t, w, a, y, n);
}

static inline float dot_exact(int t, const uint8_t *w, const float *x, int n) {
#if HAVE_X86
    if (use_avx2) return dot_exact_avx2(t, w, x, n);
#endif
    return dot_exact_c(t, w, x, n);
}

/* VNNI's fast-mode products read the activations repacked (xpair), once per product, into a
 * buffer of the calling thread (calls release the GIL), grown as needed and kept: NULL where
 * the product takes another path (then xq is read), or if it cannot grow (then AVX2's path). */
static _Thread_local xpair *xp_buf;
static _Thread_local int64_t xp_cap;
static const xpair *pack_x(int t, const q8blk *xq, int64_t ldq, int n, int B, int fast) {
#if HAVE_X86
    int nb = n / QK;
    int64_t need = is_r16(t) ? B * r16_ld(nb) : xp_size(nb, B);
    /* AVX2 packs for R16 rows only (its other products read xq) */
    if (!(fast && is_quant(t) && (use_vnni || (use_avx2 && is_r16(t)))) || need == 0) return NULL;
    if (need > xp_cap) {
        free(xp_buf);
        xp_buf = aligned_alloc(64, need * sizeof(xpair));
        xp_cap = xp_buf ? need : 0;
        if (!xp_buf) return NULL;
    }
    if (is_r16(t)) r16_pack(t, xq, ldq, nb, B, xp_buf);
    else vnni_pack(t, xq, ldq, nb, B, xp_buf);
    return xp_buf;
#else
    return NULL;
#endif
}

/* fast mode for quantized types; float types have no integer path and use x itself. xp: xq
 * packed by pack_x, or NULL */
static float r16_dot_c(int t, const uint8_t *w, const q8blk *xq, int nb);
#if HAVE_X86
AVX2 static float r16_dot_avx2(int t, const uint8_t *w, const xpair *x, int nb);
/* one R16 row times one token packed by pack_x, at the level in use */
static inline float r16_dot(int t, const uint8_t *w, const xpair *x, int nb) {
    return use_vnni ? r16_dot_vnni(t, w, x, nb) : r16_dot_avx2(t, w, x, nb);
}
#endif
static inline float dot_any(int t, const uint8_t *w, const float *x, const q8blk *xq, const xpair *xp, int n, int fast) {
    if (is_r16(t)) {  /* fast mode only (FileMatrix._rows) */
#if HAVE_X86
        if (xp) return r16_dot(t, w, xp, n / QK);
#endif
        return r16_dot_c(t, w, xq, n / QK);
    }
    if (fast && is_quant(t)) {
#if HAVE_X86
        if (xp) return dot_fast_vnni(t, w, xp, n / QK);
        if (use_avx2) return dot_fast_avx2(t, w, xq, n / QK);
#endif
        return dot_fast_c(t, w, xq, n / QK);
    }
    return dot_exact(t, w, x, n);
}

/* B tokens against one row (see dots_exact_avx2): the row is read from memory once; the
 * portable path calls the one-token dot per token while the row is in L1. */
static void dots_any(int t, const uint8_t *w, const float *x, int64_t ldx, const q8blk *xq, int64_t ldq,
                     const xpair *xp, int n, int fast, int B, int alone, float *y, int64_t ldy) {
    if (is_r16(t)) {  /* the row stays in L1 across the tokens */
        for (int b = 0; b < B; b++) {
#if HAVE_X86
            if (xp) { y[b * ldy] = r16_dot(t, w, xp + b * r16_ld(n / QK), n / QK); continue; }
#endif
            y[b * ldy] = r16_dot_c(t, w, xq + b * ldq, n / QK);
        }
        return;
    }
    if (fast && is_quant(t)) {
#if HAVE_X86
        if (xp) { dots_fast_vnni(t, w, xp, n / QK, B, alone, y, ldy); return; }
        if (use_avx2) { dots_fast_avx2(t, w, xq, ldq, n / QK, B, y, ldy); return; }
#endif
        for (int b = 0; b < B; b++) y[b * ldy] = dot_fast_c(t, w, xq + b * ldq, n / QK);
        return;
    }
#if HAVE_X86
    if (use_avx2) { dots_exact_avx2(t, w, x, ldx, n, B, y, ldy); return; }
#endif
    for (int b = 0; b < B; b++) y[b * ldy] = dot_exact_c(t, w, x + b * ldx, n);
}

/* ---- the row loops ------------------------------------------------------------------------- */

typedef struct {  /* one matrix of the file: rows of `stride` bytes, values in type `t` */
    const uint8_t *base;
    int64_t stride;
    int t;
} mat;

static inline const uint8_t *row_at(mat m, int64_t r, int64_t col0) {
    return m.base + r * m.stride + (col0 / block_size(m.t)) * type_bytes(m.t);
}
/* m with row r0 as its row 0 (a shard's rows by their offsets in it) */
static inline mat shifted(mat m, int64_t r0) {
    m.base += r0 * m.stride;
    return m;
}

/* The act argument of ffn_token/ffn_batch: the activation in its low 4 bits, how gate and up
 * combine above them (sparsecore.kernels.GATE_BITS): ACT_PAR act(gate x) * (up x); ACT_NOGATE
 * act(gate x) alone, gate being the up matrix (falcon: no up pass at all); ACT_SYM
 * act(gate x) * act(up x) (PowerInfer's bamboo). */
#define ACT_MASK 15
#define ACT_NOGATE 16
#define ACT_SYM 32
static float act_fn(int act, float g) {
    if (act == 1) return g > 0.f ? g : 0.f;                /* relu */
    if (act == 3) return 0.5f * g * (1.f + erff(g * 0.70710678118654752f));  /* gelu (erf): falcon */
    if (act == 2)                                          /* gelu_tanh (GeGLU: gemma) */
        return 0.5f * g * (1.f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)));
    return g / (1.f + expf(-g));                            /* silu */
}

/* ---- interleaved rows (X16) ------------------------------------------------------------------
 * Layout, per group of 16 rows and block of 32 columns (gb = 16 blocks' bytes: 288 for Q4_0, 320
 * for Q4_1, 544 for Q8_0): the 16 rows' f16 scales d, for Q4_1 then their 16 f16 mins, then the
 * values in runs of 64 bytes: run j holds bytes 4j..4j+3 of each row's value bytes, row r at 4r.
 * Q4: 4 runs of the 16 nibble bytes; a byte's low nibble is value 4j + c of its row, its high
 * nibble value 16 + 4j + c (GGUF's order), so one run masked (and shifted) is 4 values of 16
 * rows. Q8_0: 8 runs of the 32 values, each stored as q + 128 (unsigned, for vpdpbusd). Groups follow each other `stride` bytes
 * apart, blocks within a group gb apart; rows past the matrix's last are zeros. The same bytes
 * as the file's blocks: a token reads no more than it would there. */
static void interleave_q6k(const uint8_t *src, int64_t stride, int64_t rows, int nb, uint8_t *dst) {
    int8_t q[QKK];
    float scl[16], mn[16];
    for (int64_t g = 0; g < (rows + 15) / 16; g++)
        for (int k = 0; k < nb; k++) {
            uint8_t *p = dst + (g * nb + k) * 16 * 210;
            memset(p, 0, 16 * 210);
            for (int r = 0; r < 16 && g * 16 + r < rows; r++) {
                const uint8_t *w = src + (g * 16 + r) * stride + (int64_t)k * 210;
                kunpack(T_Q6_K, w, q, scl, mn);  /* q - 32 in the values' order */
                memcpy(p + 2 * r, w + 208, 2);
                for (int j = 0; j < 16; j++) p[Q6_SC(j) + r] = w[192 + j];
                for (int m = 0; m < 32; m++)
                    for (int c = 0; c < 4; c++)
                        p[Q6_L(m) + 4 * r + c] = (uint8_t)(((q[8 * m + c] + 32) & 15) | (((q[8 * m + 4 + c] + 32) & 15) << 4));
                for (int n = 0; n < 16; n++)
                    for (int c = 0; c < 4; c++) {
                        int v = 0;
                        for (int t4 = 0; t4 < 4; t4++) v |= (((q[16 * n + 4 * t4 + c] + 32) >> 4) & 3) << (2 * t4);
                        p[Q6_H(n) + 4 * r + c] = (uint8_t)v;
                    }
            }
        }
}

/* Q4_K (2368 bytes a group's block): the 16 rows' d, then dmin (f16), then per sub-block pair
 * p the rows' 6-bit scales (Q4K_SC) and mins (Q4K_MN) of sub-blocks 2p and 2p + 1 a byte each,
 * then 8 runs of 64 bytes (Q4K_V(p) + 64 j): bytes 32 p + 4 j .. + 3 of each row's qs, whose
 * low nibbles are sub-block 2p's values 4j.. and high ones 2p + 1's. */
static void interleave_q4k(const uint8_t *src, int64_t stride, int64_t rows, int nb, uint8_t *dst) {
    for (int64_t g = 0; g < (rows + 15) / 16; g++)
        for (int k = 0; k < nb; k++) {
            uint8_t *p = dst + (g * nb + k) * 2368;
            memset(p, 0, 2368);
            for (int r = 0; r < 16 && g * 16 + r < rows; r++) {
                const uint8_t *w = src + (g * 16 + r) * stride + (int64_t)k * 144;
                memcpy(p + 2 * r, w, 2);
                memcpy(p + 32 + 2 * r, w + 2, 2);
                for (int j = 0; j < 8; j++) {
                    int sc, m;
                    kscale_min(w + 4, j, &sc, &m);
                    p[Q4K_SC(j) + r] = (uint8_t)sc;
                    p[Q4K_MN(j) + r] = (uint8_t)m;
                }
                for (int pp = 0; pp < 4; pp++)
                    for (int j = 0; j < 8; j++) memcpy(p + Q4K_V(pp) + 64 * j + 4 * r, w + 16 + 32 * pp + 4 * j, 4);
            }
        }
}

/* A run of L lanes of Q4_0, Q4_1 or Q8_0 blocks at p (L x the block's bytes): the n blocks at w,
 * `stride` apart, in lanes 0..n-1 (the rest left as they are: zeros): their f16 scales, for Q4_1
 * then their mins, then the values, run j holding bytes 4j..4j+3 of each lane's value bytes */
static void interleave_run(int t, const uint8_t *w, int64_t stride, int n, int L, uint8_t *p) {
    int q41 = t == T_Q4_1, q8 = t == T_Q8_0, h = run_head(t, L);
    for (int r = 0; r < n; r++, w += stride) {
        memcpy(p + 2 * r, w, 2);
        if (q41) memcpy(p + 2 * L + 2 * r, w + 2, 2);
        for (int j = 0; j < (q8 ? 8 : 4); j++) {
            uint8_t *o = p + h + 4 * L * j + 4 * r;
            memcpy(o, w + (q41 ? 4 : 2) + 4 * j, 4);
            if (q8)  /* signed q as unsigned q + 128 (vpdpbusd's unsigned side) */
                for (int c = 0; c < 4; c++) o[c] ^= 0x80;
        }
    }
}

static void interleave(int t, const uint8_t *src, int64_t stride, int64_t rows, int nb, uint8_t *dst) {
    if (t == T_Q6_K) { interleave_q6k(src, stride, rows, nb, dst); return; }
    if (t == T_Q4_K) { interleave_q4k(src, stride, rows, nb, dst); return; }
    int tb = type_bytes(t), gb = 16 * tb;
    for (int64_t g = 0; g < (rows + 15) / 16; g++)
        for (int k = 0; k < nb; k++) {
            uint8_t *p = dst + (g * nb + k) * gb;
            memset(p, 0, gb);
            int n = rows - g * 16 < 16 ? (int)(rows - g * 16) : 16;
            interleave_run(t, src + g * 16 * stride + (int64_t)k * tb, stride, n, 16, p);
        }
}

/* R16 (FileMatrix.interleave_blocks): each row's blocks in runs of 16, a row's last run of
 * fewer (nb % 16) as a run of that many lanes; rows stay `nb` blocks' bytes apart in dst */
static void interleave_blocks(int t, const uint8_t *src, int64_t stride, int64_t rows, int nb, uint8_t *dst) {
    int tb = type_bytes(t);
    for (int64_t r = 0; r < rows; r++)
        for (int c = 0; c < nb; c += 16) {
            int L = nb - c < 16 ? nb - c : 16;
            interleave_run(t, src + r * stride + (int64_t)c * tb, tb, L, L, dst + (r * nb + c) * tb);
        }
}

/* The stored unsigned value i of row r in an X16 block p (interleave's layouts): Q4_0, Q4_1 and
 * Q4_K a nibble, Q8_0 q + 128, Q6_K 6 bits */
static inline int x16_value(int t, const uint8_t *p, int r, int i) {
    if (t == X16 + T_Q6_K) {
        int quad = i / 4, c = i % 4;
        int lo = (p[Q6_L(quad / 2) + 4 * r + c] >> (4 * (quad & 1))) & 15;
        int hi = (p[Q6_H(i / 16) + 4 * r + c] >> (2 * (quad % 4))) & 3;
        return lo | (hi << 4);
    }
    if (t == X16 + T_Q4_K) {
        int sb = i / 32, l = i % 32;
        return (p[Q4K_V(sb / 2) + 64 * (l / 4) + 4 * r + l % 4] >> (4 * (sb & 1))) & 15;
    }
    return run_value(t - X16, p, 16, r, i);
}

/* One block (at p) of row r of an X16 Q4_0, Q4_1 or Q8_0 group times one token's q8 block x,
 * added to acc: the VNNI tile's lane, operation for operation (fmaf: its fused multiply-adds) */
static inline float x16_block_c(int t, const uint8_t *p, int L, int r, const q8blk *x, float acc) {
    int32_t s = x16_offset(t, x->s);
    for (int i = 0; i < QK; i++) s += run_value(t - X16, p, L, r, i) * x->q[i];
    float d = f16_to_f32(rd16(p + 2 * r));
    if (t == X16 + T_Q4_1) return fmaf(fmaf((float)s, d, f16_to_f32(rd16(p + 2 * L + 2 * r)) * (float)x->s), x->d, acc);
    return fmaf((float)s, d * x->d, acc);
}

/* Row r of the group at g (nb blocks) dotted with one token (its q8 blocks x; Q6_K: hs, its sums
 * over each 16 values): the VNNI tiles' lane for that row, operation for operation (fmaf: their
 * fused multiply-adds), so both paths give the same floats. */
static float x16_lane_c(int t, const uint8_t *g, int nb, int r, const q8blk *xq, const int32_t *hs) {
    float acc = 0.f;
    if (t == X16 + T_Q4_K) {
        for (int k = 0; k < nb; k++, g += 2368) {
            float d = f16_to_f32(rd16(g + 2 * r)), dm = f16_to_f32(rd16(g + 32 + 2 * r));
            for (int sb = 0; sb < 8; sb++) {
                const q8blk *x = xq + 8 * k + sb;
                int32_t sum = 0;
                for (int l = 0; l < QK; l++) sum += x16_value(t, g, r, 32 * sb + l) * x->q[l];
                float dsc = d * (float)g[Q4K_SC(sb) + r], dmm = dm * (float)g[Q4K_MN(sb) + r];
                acc = fmaf(fmaf((float)sum, dsc, -(dmm * (float)x->s)), x->d, acc);
            }
        }
        return acc;
    }
    if (t == X16 + T_Q6_K) {
        for (int k = 0; k < nb; k++, g += 16 * 210) {
            float d = f16_to_f32(rd16(g + 2 * r));
            for (int xb = 0; xb < 8; xb++) {
                const q8blk *x = xq + 8 * k + xb;
                const int32_t *hb = hs + 2 * (8 * k + xb);
                int32_t sab[2];
                for (int h = 0; h < 2; h++) {
                    sab[h] = -32 * hb[h];
                    for (int i = 0; i < 16; i++) sab[h] += x16_value(t, g, r, 32 * xb + 16 * h + i) * x->q[16 * h + i];
                }
                int32_t si = sab[0] * (int8_t)g[Q6_SC(2 * xb) + r] + sab[1] * (int8_t)g[Q6_SC(2 * xb + 1) + r];
                acc = fmaf((float)si, d * x->d, acc);
            }
        }
        return acc;
    }
    int gb = 16 * type_bytes(t - X16);
    for (int k = 0; k < nb; k++, g += gb) acc = x16_block_c(t, g, 16, r, xq + k, acc);
    return acc;
}

/* One row of an R16 matrix (nb blocks) dotted with one token's q8 blocks:
 * lane k of the VNNI kernel (r16_dot_vnni) accumulates blocks k, k + 16, ... as X16's lane
 * for its row does, then the 16 lanes are summed as hsum16 sums them: the same floats. */
static float r16_dot_c(int t, const uint8_t *w, const q8blk *xq, int nb) {
    int xt = t - R16 + X16, gb = 16 * type_bytes(t);
    float acc[16] = {0};
    for (int c = 0; c < nb; c += 16, w += gb) {
        int L = nb - c < 16 ? nb - c : 16;  /* the last run's missing lanes add zeros, as r16_run's */
        for (int k = 0; k < 16; k++) acc[k] = k < L ? x16_block_c(xt, w, L, k, xq + c + k, acc[k]) : acc[k] + 0.f;
    }
    for (int k = 0; k < 8; k++) acc[k] += acc[k + 8];
    for (int k = 0; k < 4; k++) acc[k] += acc[k + 4];
    return (acc[0] + acc[2]) + (acc[1] + acc[3]);
}

/* Portable fast-mode products on X16 rows (every ISA level below VNNI) */
static void x16_rows_c(int t, const uint8_t *g, int64_t gstride, int64_t n_rows, int nb, const q8blk *xq,
                       int64_t ldq, const int32_t *hs, int64_t ldh, int B, float *y, int64_t ldy) {
    for (int64_t r0 = 0; r0 < n_rows; r0 += 16, g += gstride)
        for (int b = 0; b < B; b++)
            for (int r = 0; r < 16 && r0 + r < n_rows; r++)
                y[b * ldy + r0 + r] = x16_lane_c(t, g, nb, r, xq + b * ldq, hs ? hs + b * ldh : NULL);
}

/* Rows [start, start + n_rows) (start on a group) of an X16 matrix, columns [col0, col0 + n),
 * for B tokens' q8 blocks (fast mode only: the layout has no float path) */
static _Thread_local void *hs_buf;
static _Thread_local int64_t hs_cap;
#if HAVE_X86
AVX2 static void x16_rows_avx2(int t, const uint8_t *g, int64_t gstride, int64_t n_rows, int nb, const q8blk *xq,
                               int64_t ldq, const int32_t *hs, int64_t ldh, int B, float *y, int64_t ldy);
#endif
static void x16_products(mat m, int64_t start, int64_t n_rows, int64_t col0, int n, const q8blk *xq, int64_t ldq,
                         int B, float *y, int64_t ldy) {
    int bs = block_size(m.t - X16), nb = n / bs;
    const uint8_t *g = m.base + (start / 16) * m.stride + (col0 / bs) * x16_block_bytes(m.t);
    int64_t ldh = 2 * (n / QK);
    int32_t *hs = NULL;
    if (m.t == X16 + T_Q6_K) {  /* each token's sums of x over 16 values: the sub-blocks' offsets */
        hs = grown(&hs_buf, &hs_cap, sizeof(int32_t) * B * ldh);
        if (!hs) {  /* out of memory for a few KB: zeros rather than garbage */
            for (int b = 0; b < B; b++) memset(y + b * ldy, 0, sizeof(float) * n_rows);
            return;
        }
        for (int b = 0; b < B; b++)
            for (int64_t i = 0; i < ldh; i++) {
                int32_t sum = 0;
                for (int j = 0; j < 16; j++) sum += xq[b * ldq + i / 2].q[16 * (i % 2) + j];
                hs[b * ldh + i] = sum;
            }
    }
#if HAVE_X86
    if (use_vnni) { x16_rows_vnni(m.t, g, m.stride, n_rows, nb, xq, ldq, hs, ldh, B, y, ldy); return; }
    if (use_avx2) { x16_rows_avx2(m.t, g, m.stride, n_rows, nb, xq, ldq, hs, ldh, B, y, ldy); return; }
#endif
    x16_rows_c(m.t, g, m.stride, n_rows, nb, xq, ldq, hs, ldh, B, y, ldy);
}

/* y[i] = row(rows[i] or start + i)[col0 : col0 + n] . x for i < n_rows */
/* Rows read in part (down's columns of one shard) or out of order break the hardware
 * prefetcher's streams: ask for the row PREFETCH_ROWS ahead, a cache line at a time. */
#define PREFETCH_ROWS 4
static inline void prefetch_row(const uint8_t *p, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + o, 0, 0);
}
/* the same into L2 (prefetcht1): rows picked at random come faster with more misses in flight
 * than L1's fill buffers hold (R16_AHEAD; PowerInfer's down_t rows: 1.1B ReLU shard's FFN
 * 94-104 -> 87-91 us a layer) */
static inline void prefetch_row_l2(const uint8_t *p, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + o, 0, 2);
}

#if HAVE_X86
/* A cursor runs R16_AHEAD runs ahead over the (row, run) sequence an R16 loop reads, asking for
 * each into L2 (prefetcht1): rows picked at random, 1.1 KB each, came at 9-11 GB/s on one core
 * with no prefetch or prefetches into L1 (too few misses in flight), 21-23 GB/s with these (the
 * 1.1B shape's up rows, DRAM, half of them: 212 us, all of X16's 237). The loop fetches one run
 * ahead per run it reads. */
#define R16_AHEAD 128
typedef struct {
    mat m;
    const int32_t *rows;  /* the rows picked, or NULL: start, start + 1, .. */
    int64_t start, n, i, gb;
    int c, nc;  /* the next run to fetch: run c of the cursor's row i, of nc a row */
} r16_cursor;
static inline void r16_fetch(r16_cursor *k) {
    if (k->i >= k->n) return;
    const char *p = (const char *)row_at(k->m, k->rows ? k->rows[k->i] : k->start + k->i, 0) + k->c * k->gb;
    for (int o = 0; o < k->gb; o += 64) _mm_prefetch(p + o, _MM_HINT_T1);
    if (++k->c == k->nc) { k->c = 0; k->i++; }
}
static inline r16_cursor r16_cursor_at(mat m, const int32_t *rows, int64_t start, int64_t n, int nb) {
    r16_cursor k = {m, rows, start, n, 0, 16 * (int64_t)type_bytes(m.t), 0, (nb + 15) / 16};
    for (int j = 0; j < R16_AHEAD; j++) r16_fetch(&k);
    return k;
}

VNNI static INLINE void r16_rows_t(const int t, mat m, const int32_t *rows, int64_t start, int64_t n, const xpair *x,
                                   int nb, float *y) {
    const int64_t gb = 16 * type_bytes(t);
    r16_cursor cur = r16_cursor_at(m, rows, start, n, nb);
    int64_t i = 0;
    for (; i + 1 < n; i += 2) {  /* two rows at a time: their chains interleave */
        const uint8_t *w0 = row_at(m, rows ? rows[i] : start + i, 0), *w1 = row_at(m, rows ? rows[i + 1] : start + i + 1, 0);
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
        int c = 0;
        for (; c + 16 <= nb; c += 16) {
            r16_fetch(&cur);
            r16_fetch(&cur);
            a0 = r16_run(t, w0 + c / 16 * gb, 16, x + 10 * (c / 16), a0);
            a1 = r16_run(t, w1 + c / 16 * gb, 16, x + 10 * (c / 16), a1);
        }
        if (c < nb) {
            r16_fetch(&cur);
            r16_fetch(&cur);
            a0 = r16_run(t, w0 + c / 16 * gb, nb - c, x + 10 * (c / 16), a0);
            a1 = r16_run(t, w1 + c / 16 * gb, nb - c, x + 10 * (c / 16), a1);
        }
        y[i] = hsum16(a0);
        y[i + 1] = hsum16(a1);
    }
    if (i < n) y[i] = hsum16(r16_row(t, row_at(m, rows ? rows[i] : start + i, 0), nb, x, _mm512_setzero_ps()));
}
/* y[i] = row (rows[i], else start + i) . x for i < n (x: one token packed by r16_pack): every
 * picked row of a step in one call (called a row at a time through dot_any, with no cursor
 * and no pairs, a 4-run row cost some 60 ns in L2; 37 ns here) */
VNNI static void r16_rows_vnni(mat m, const int32_t *rows, int64_t start, int64_t n, const xpair *x, int nb, float *y) {
    if (m.t == R16 + T_Q4_0) r16_rows_t(R16 + T_Q4_0, m, rows, start, n, x, nb, y);
    else if (m.t == R16 + T_Q4_1) r16_rows_t(R16 + T_Q4_1, m, rows, start, n, x, nb, y);
    else r16_rows_t(R16 + T_Q8_0, m, rows, start, n, x, nb, y);
}

/* the interleaved layouts' AVX2 kernels (X16 tiles, R16 rows) */
#include "interleaved_avx2.c"

/* every picked R16 row of a step in one call, at the level in use (x: r16_pack's, pack_x) */
static void r16_rows(mat m, const int32_t *rows, int64_t start, int64_t n, const xpair *x, int nb, float *y) {
    if (use_vnni) r16_rows_vnni(m, rows, start, n, x, nb, y);
    else r16_rows_avx2(m, rows, start, n, x, nb, y);
}
#endif

static void matvec(mat m, const int32_t *rows, int64_t start, int64_t n_rows, int64_t col0, int n,
                   const float *x, const q8blk *xq, int fast, float *y) {
    if (is_x16(m.t)) { x16_products(m, start, n_rows, col0, n, xq, 0, 1, y, 1); return; }
    int64_t bytes = (int64_t)n / block_size(m.t) * type_bytes(m.t);
    int partial = n * type_bytes(m.t) / block_size(m.t) < m.stride || rows != NULL;
    const xpair *xp = pack_x(m.t, xq, 0, n, 1, fast);
#if HAVE_X86
    if (is_r16(m.t) && xp && col0 == 0) { r16_rows(m, rows, start, n_rows, xp, n / QK, y); return; }
#endif
    for (int64_t i = 0; i < n_rows; i++) {
        int64_t r = rows ? rows[i] : start + i;
        if (partial && i + PREFETCH_ROWS < n_rows)
            prefetch_row(row_at(m, rows ? rows[i + PREFETCH_ROWS] : start + i + PREFETCH_ROWS, col0), bytes);
        y[i] = dot_any(m.t, row_at(m, r, col0), x, xq, xp, n, fast);
    }
}

/* THE hot function: one token's partial FFN over owned neurons [own0, own0 + n_own) of the layer
 * (a contiguous range on whole blocks of down's rows, 32 or 256, as the static plan hands them out). gate, up: (n_ff rows,
 * hidden cols); down: (hidden rows, n_ff cols). Active: dense (threshold < 0 and no mask), a
 * predictor's mask over all n_ff neurons, or |act(gate x)| > threshold. h: scratch of n_own
 * floats; hq: scratch of n_own / 32 q8 blocks; xq: scratch of hidden / 32 q8 blocks.
 * Returns the number of active neurons. */
/* Owned neurons to visit, as offsets into the shard, per thread (grown on demand) */
static _Thread_local void *list_buf;
static _Thread_local int64_t list_cap;
static int32_t *neuron_list(int64_t n) { return grown(&list_buf, &list_cap, sizeof(int32_t) * n); }

static void matmul(mat m, const int32_t *rows, int64_t start, int64_t n_rows, int64_t col0, int n, const float *x,
                   int64_t ldx, const q8blk *xq, int64_t ldq, int B, int fast, float *y, int64_t ldy);

/* up's products of a dense shard on X16 rows (B n_own floats), per thread, grown on demand */
static _Thread_local void *up_buf;
static _Thread_local int64_t up_cap;
static float *up_scratch(int64_t n) { return grown(&up_buf, &up_cap, sizeof(float) * n); }

/* Interleaved gate rows (X16: FileLayer, fast mode, down not transposed) serve dense and
 * threshold steps: gate's products for all B tokens in one pass over the groups, into h
 * (B n_own, raw). With up interleaved too (an engine that only decodes densely), dense steps
 * only: h = act(gate x) * (up x) in full (returns 1). Returns 0 when the caller goes on with
 * the raw gate values, -1 (no memory) or -2 (a step these rows cannot take: a caller's error,
 * a mask, or a threshold with up interleaved). xq: the tokens' q8 blocks. */
static int gate_x16(mat gate, mat up, int hidden, int64_t own0, int64_t n_own, int act, int sparse, int masked,
                    int down_t, int fast, const float *x, const q8blk *xq, int B, float *h) {
    int mode = act & ~ACT_MASK;
    act &= ACT_MASK;
    int up_x16 = mode != ACT_NOGATE && is_x16(up.t);
    if (masked || down_t || !fast || own0 % 16 || (up_x16 && sparse)) return -2;
    matmul(gate, NULL, own0, n_own, 0, hidden, x, hidden, xq, hidden / QK, B, fast, h, n_own);
    if (!up_x16) return 0;
    float *u = up_scratch((int64_t)B * n_own);
    if (!u) return -1;
    matmul(up, NULL, own0, n_own, 0, hidden, x, hidden, xq, hidden / QK, B, fast, u, n_own);
    for (int64_t i = 0; i < (int64_t)B * n_own; i++) {
        float g = act_fn(act, h[i]);
        h[i] = g * (mode == ACT_SYM ? act_fn(act, u[i]) : u[i]);
    }
    return 1;
}

static int64_t ffn_token(mat gate, mat up, mat down, int down_t, int hidden, int64_t own0, int64_t n_own, int act,
                         float threshold, const uint8_t *mask, const float *x, int fast,
                         float *h, q8blk *xq, q8blk *hq, float *y) {
    int32_t *live = neuron_list(n_own);
    if (!live) return -1;
    if (fast) quantize_q8(x, hidden, xq);
    int mode = act & ~ACT_MASK;
    act &= ACT_MASK;
    int64_t n_active = 0, n_live = 0, n_gate = n_own;
    int64_t gbytes = (int64_t)hidden / block_size(gate.t) * type_bytes(gate.t);
    int64_t ubytes = (int64_t)hidden / block_size(up.t) * type_bytes(up.t);
    int x16 = is_x16(gate.t) ? gate_x16(gate, up, hidden, own0, n_own, act | mode, threshold >= 0.f, mask != NULL,
                                        down_t, fast, x, xq, 1, h) : 0;
    if (x16 < 0) return x16;
    if (x16 == 1) {  /* dense, gate and up interleaved: h is complete */
        if (n_own == 0) { memset(y, 0, sizeof(float) * hidden); return 0; }
        quantize_q8(h, (int)n_own, hq);
        matvec(down, NULL, 0, hidden, own0, (int)n_own, h, hq, fast, y);
        return n_own;
    }
    int x16_gate = is_x16(gate.t);  /* then h holds gate x already (gate_x16; no mask there) */
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
    const xpair *xp = x16_gate ? NULL : pack_x(gate.t, xq, 0, hidden, 1, fast);
    float *picked = NULL;  /* R16 rows' products, all in one call (r16_rows), then used in turn */
#if HAVE_X86
    if (is_r16(gate.t) && xp) {
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
            raw = dot_any(gate.t, row_at(gate, own0 + i, 0), x, xq, xp, hidden, fast);
        }
        float g = act_fn(act, raw);
        if (threshold >= 0.f && !(fabsf(g) > threshold)) continue;  /* sparsecore.ffn.is_active */
        n_active++;
        if (g == 0.f) continue;
        h[i] = g;
        live[n_live++] = (int32_t)i;  /* n_live <= j: the gate list is read ahead of this */
    }
    /* up's pack: the gate's where up has gate's type (the same bytes), else its own */
    if (mode != ACT_NOGATE && !(xp && up.t == gate.t)) xp = pack_x(up.t, xq, 0, hidden, 1, fast);
    picked = NULL;
#if HAVE_X86
    if (mode != ACT_NOGATE && is_r16(up.t) && xp) {
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
            u = dot_any(up.t, row_at(up, own0 + i, 0), x, xq, xp, hidden, fast);
        }
        h[i] *= mode == ACT_SYM ? act_fn(act, u) : u;
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

#define TILE_ROWS_B 8      /* tokens per pass over a block of rows (TILE_V of the VNNI kernel) */
#define MATMUL_ROW_BLOCK 256 /* rows per block: read again per tile of tokens from L2 (256 rows of the 1.1B shape: 0.3 MB) */
static inline int64_t xp_ld_any(int t, int n) {  /* one token's share of pack_x's buffer */
#if HAVE_X86
    return is_r16(t) ? r16_ld(n / QK) : xp_ld(n / QK);
#else
    (void)t, (void)n;
    return 0;
#endif
}

/* matvec for B tokens (2..MAXB; continuous batching): Y[b][i] = row_i[col0 : col0 + n] . x_b,
 * each row read once for all B. Token b's x at x + b ldx, its q8 blocks (fast) at xq + b ldq,
 * its outputs at y + b ldy. Per token the same float operations as matvec. */
static void matmul(mat m, const int32_t *rows, int64_t start, int64_t n_rows, int64_t col0, int n,
                   const float *x, int64_t ldx, const q8blk *xq, int64_t ldq, int B, int fast, float *y, int64_t ldy) {
    if (is_x16(m.t)) { x16_products(m, start, n_rows, col0, n, xq, ldq, B, y, ldy); return; }
    int64_t bytes = (int64_t)n / block_size(m.t) * type_bytes(m.t);
    int partial = n * type_bytes(m.t) / block_size(m.t) < m.stride || rows != NULL;
    const xpair *xp = pack_x(m.t, xq, ldq, n, B, fast);
    /* More tokens than a tile: rows in blocks, each block read once per tile of tokens (again
     * from L2), so that a tile's activations stay in L1: a row read for all 16 tokens at once
     * pushed them out (1.1B shape: 16 tokens cost 2.5 times 8; in blocks of 256 rows, 1.9
     * times; 16 rows, 2.2). A token's floats are the same whatever its tile. */
    int64_t block = B > TILE_ROWS_B ? MATMUL_ROW_BLOCK : n_rows;
    for (int64_t i0 = 0; i0 < n_rows; i0 += block) {
        int64_t i1 = i0 + block < n_rows ? i0 + block : n_rows;
        for (int b0 = 0; b0 < B; b0 += TILE_ROWS_B) {
            int nt = B - b0 < TILE_ROWS_B ? B - b0 : TILE_ROWS_B;
            const xpair *xpt = xp ? xp + b0 * xp_ld_any(m.t, n) : NULL;
            for (int64_t i = i0; i < i1; i++) {
                int64_t r = rows ? rows[i] : start + i;
                if (partial && i + PREFETCH_ROWS < n_rows && b0 == 0)
                    prefetch_row(row_at(m, rows ? rows[i + PREFETCH_ROWS] : start + i + PREFETCH_ROWS, col0), bytes);
                dots_any(m.t, row_at(m, r, col0), x + b0 * ldx, ldx, xq + b0 * ldq, ldq, xpt, n, fast, nt, B == 1,
                         y + (int64_t)b0 * ldy + i, ldy);
            }
        }
    }
}

/* ffn_token for B tokens (x: B rows of hidden) in one pass over the shard's rows: each gate row
 * is read once for all B; a neuron's up row and down column are read when it is active for at
 * least one token (a neuron inactive for every token is skipped as ffn_token skips it). Per
 * token the same decisions and float operations as ffn_token, so a token gets the same output
 * alone or in a batch. thr: B thresholds (< 0: dense for that token) or NULL (all dense); mask
 * (a predictor's, over all n_ff neurons) is the same for every token. Scratch: h (B n_own),
 * any (n_own), xq (B hidden/32 blocks), hq (B ceil(n_own/32) blocks). counts[b]: token b's
 * active neurons; returns their sum. y: B rows of hidden. */
static int64_t ffn_batch(mat gate, mat up, mat down, int down_t, int hidden, int64_t own0, int64_t n_own, int act,
                         const float *thr, const uint8_t *mask, const float *x, int B, int fast,
                         float *h, uint8_t *any, q8blk *xq, q8blk *hq, int64_t *counts, float *y) {
    int mode = act & ~ACT_MASK;
    act &= ACT_MASK;
    int64_t ldq = hidden / QK, ldhq = (n_own + QK - 1) / QK, total = 0;
    if (fast)
        for (int b = 0; b < B; b++) quantize_q8(x + (int64_t)b * hidden, hidden, xq + b * ldq);
    int64_t gbytes = (int64_t)hidden / block_size(gate.t) * type_bytes(gate.t);
    int64_t ubytes = (int64_t)hidden / block_size(up.t) * type_bytes(up.t);
    float g[MAXB];
    int x16 = 0;
    if (is_x16(gate.t)) {
        int sparse = 0;
        for (int b = 0; thr && b < B; b++) sparse |= thr[b] >= 0.f;
        x16 = gate_x16(gate, up, hidden, own0, n_own, act | mode, sparse, mask != NULL, down_t, fast, x, xq, B, h);
        if (x16 < 0) return x16;
    }
    if (x16 == 1) {  /* dense, gate and up interleaved: h is complete */
        for (int b = 0; b < B; b++) counts[b] = n_own;
        if (n_own == 0) { memset(y, 0, sizeof(float) * hidden * B); return 0; }
        for (int b = 0; b < B; b++) quantize_q8(h + b * n_own, (int)n_own, hq + b * ldhq);
        matmul(down, NULL, 0, hidden, own0, (int)n_own, h, n_own, hq, ldhq, B, fast, y, hidden);
        return (int64_t)B * n_own;
    }
    const xpair *xp = is_x16(gate.t) ? NULL : pack_x(gate.t, xq, ldq, hidden, B, fast);  /* x16: gate x is in h */
    for (int b = 0; b < B; b++) counts[b] = 0;
    for (int64_t i = 0; i < n_own; i++) {  /* gate: who is active, per token */
        int64_t n = own0 + i;
        any[i] = 0;
        if (is_x16(gate.t))  /* gate_x16 left gate x in h */
            for (int b = 0; b < B; b++) g[b] = h[b * n_own + i];
        for (int b = 0; b < B; b++) h[b * n_own + i] = 0.f;
        if (mask) {
            if (i + PREFETCH_ROWS < n_own && mask[n + PREFETCH_ROWS]) prefetch_row(row_at(gate, n + PREFETCH_ROWS, 0), gbytes);
            if (!mask[n]) continue;
        }
        if (!is_x16(gate.t)) dots_any(gate.t, row_at(gate, n, 0), x, hidden, xq, ldq, xp, hidden, fast, B, B == 1, g, 1);
        for (int b = 0; b < B; b++) {
            float v = act_fn(act, g[b]);
            if (thr && thr[b] >= 0.f && !(fabsf(v) > thr[b])) continue;  /* sparsecore.ffn.is_active */
            h[b * n_own + i] = v;
            counts[b]++;
            if (v != 0.f) any[i] = 1;
        }
    }
    if (mode != ACT_NOGATE && !(xp && up.t == gate.t)) xp = pack_x(up.t, xq, ldq, hidden, B, fast);  /* as ffn_token */
    for (int64_t i = 0; i < n_own && mode != ACT_NOGATE; i++) {  /* up, for neurons some token needs */
        if (i + PREFETCH_ROWS < n_own && any[i + PREFETCH_ROWS])
            prefetch_row(row_at(up, own0 + i + PREFETCH_ROWS, 0), ubytes);
        if (!any[i]) continue;
        dots_any(up.t, row_at(up, own0 + i, 0), x, hidden, xq, ldq, xp, hidden, fast, B, B == 1, g, 1);
        for (int b = 0; b < B; b++)
            if (h[b * n_own + i] != 0.f) h[b * n_own + i] *= mode == ACT_SYM ? act_fn(act, g[b]) : g[b];
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

/* One decoded token's attention block for one layer, in place on the residual h (hidden):
 *   x = rmsnorm(h) * norm_w;  q, k, v = Wq x, Wk x, Wv x (Q and K rows in un-permuted order)
 *   rotate-half RoPE on q and k at `pos` (cos, and sin with the first half negated, as the
 *   Python model's tables hold them); k, v into the layer's cache at pos;
 *   per query head: softmax(q . K[0..pos] / sqrt(hd)) . V[0..pos] (query head i reads KV head
 *   i / (n_heads / n_kv)); h += Wo (heads side by side).
 * The same arithmetic as coordinator/model.py's torch path in float32, in one call instead of
 * some twenty small torch operations (each 3-10 us, most of a small model's token). */
typedef struct {
    float *x, *q, *k, *v, *att, *out;
    q8blk *xq, *oq;
} attn_scratch;

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

/* x = RMSNorm(h) * w (the double sum keeps long rows exact enough to match torch's) */
#if HAVE_X86
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
#endif

static void rms_norm_into(const float *h, const float *w, float eps, int n, float *x) {
    double ss = 0.0;
#if HAVE_X86
    if (use_avx2) ss = sum_squares_avx2(h, n);
    else
#endif
    for (int i = 0; i < n; i++) ss += (double)h[i] * h[i];
    float r = 1.f / sqrtf((float)(ss / n) + eps);
    for (int i = 0; i < n; i++) x[i] = h[i] * r * w[i];
}

/* ---- softmax attention over one KV head's n cached positions, for g query heads -------------
 * Portable: per head, two passes (the scores into att, then the weighted sum of the V rows).
 * AVX2 / AVX-512: the positions in chunks of one vector width W (8 / 16). Per chunk and head, W
 * scores as one vector (W dot products side by side, one horizontal reduction for all W), then
 * an online softmax (FlashAttention's recurrence): the running max m, the sum l of e^(s - m) and
 * the unnormalized output in out, both rescaled when a chunk raises m; out / l at the end. The
 * chunk's K and V rows come from memory for the first head and from L1 for the group's others,
 * and no scratch grows with the context. Other float orders than the portable path, tested
 * against float64 (tests/test_attend_kernel.py). */
static void attend_heads_c(const float *q, int g, const float *K, const float *V, int n, int hd, float scale,
                           float *att, float *out) {
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
        memset(o, 0, sizeof(float) * hd);
        for (int p = 0; p < n; p++) {
            const float *v = V + (int64_t)p * hd;
            float a = att[p] / sum;
            for (int i = 0; i < hd; i++) o[i] += a * v[i];
        }
    }
}

#if HAVE_X86
#define MAXG 16  /* query heads per SIMD call (a larger GQA group goes in turns) */

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
                               float *out) {
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
        __m256 r = _mm256_set1_ps(1.f / hsum8(l[h]));
        for (int s = 0; s < hd; s += 8) _mm256_storeu_ps(out + h * hd + s, _mm256_mul_ps(_mm256_loadu_ps(out + h * hd + s), r));
    }
}

/* attend_heads_c for hd a multiple of 8 and g <= MAXG; hd a constant for the common sizes (the
 * loops unrolled, the rows addressed without multiplies: ~20% faster) */
AVX2 static void attend_heads_avx2(const float *q, int g, const float *K, const float *V, int n, int hd, float scale,
                                   float *out) {
    if (hd == 64) heads8(q, g, K, V, n, 64, scale, out);
    else if (hd == 128) heads8(q, g, K, V, n, 128, scale, out);
    else heads8(q, g, K, V, n, hd, scale, out);
}

/* the same with AVX-512, W = 16 */
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
                                float *out) {
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
        __m512 r = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(l[h]));
        for (int s = 0; s < hd; s += 16) _mm512_storeu_ps(out + h * hd + s, _mm512_mul_ps(_mm512_loadu_ps(out + h * hd + s), r));
    }
}

VNNI static void attend_heads_avx512(const float *q, int g, const float *K, const float *V, int n, int hd, float scale,
                                     float *out) {
    if (hd == 64) heads16(q, g, K, V, n, 64, scale, out);
    else if (hd == 128) heads16(q, g, K, V, n, 128, scale, out);
    else heads16(q, g, K, V, n, hd, scale, out);
}
#endif

/* One sequence at position pos: rope on q and k, k and v into the cache, then per query head
 * softmax(q . K[0..pos] / sqrt(hd)) . V[0..pos] into out (query head i reads KV head i / group).
 * n_heads, n_kv may be a slice of the model's heads, with kc and vc at its first KV head. */
static void attend(float *q, float *k, const float *v, int n_heads, int n_kv, int hd, int d, const float *cos_r,
                   const float *sin_r, int pos, float *kc, float *vc, int max_ctx, float *att, float *out) {
    rope(q, n_heads, hd, d, cos_r, sin_r);
    rope(k, n_kv, hd, d, cos_r, sin_r);
    for (int j = 0; j < n_kv; j++) {
        memcpy(kc + ((int64_t)j * max_ctx + pos) * hd, k + j * hd, sizeof(float) * hd);
        memcpy(vc + ((int64_t)j * max_ctx + pos) * hd, v + j * hd, sizeof(float) * hd);
    }
    float scale = 1.f / sqrtf((float)hd);
    int group = n_heads / n_kv;
    for (int j = 0; j < n_kv; j++) {
        const float *K = kc + (int64_t)j * max_ctx * hd, *V = vc + (int64_t)j * max_ctx * hd;
        float *qj = q + (int64_t)j * group * hd, *oj = out + (int64_t)j * group * hd;
#if HAVE_X86
        if (use_avx2 && hd % 8 == 0) {
            for (int h = 0; h < group; h += MAXG) {
                int g = group - h < MAXG ? group - h : MAXG;
                if (use_vnni && hd % 16 == 0) attend_heads_avx512(qj + h * hd, g, K, V, pos + 1, hd, scale, oj + h * hd);
                else attend_heads_avx2(qj + h * hd, g, K, V, pos + 1, hd, scale, oj + h * hd);
            }
            continue;
        }
#endif
        attend_heads_c(qj, group, K, V, pos + 1, hd, scale, att, oj);
    }
}

/* The attention of KV heads [kv0, kv1) (and their query heads) for B sequences decoded together
 * (continuous batching), each at its own position with its own KV cache: RMSNorm per row, the
 * Q, K, V rows of those heads read once for all B (matmul), rope, the cache write and softmax
 * attention per sequence, then those heads' columns of the output product: `part` (B rows of
 * hidden) gets their share of the attention output. The shares of disjoint head ranges summed
 * are the whole attention (what lets processes split a layer's heads: coordinator/
 * attention_split.py). Per sequence the same float operations whatever B, so a sequence decodes
 * the same alone or in a batch. cos_t, sin_t: the whole tables (max_ctx rows of d); kcs[b],
 * vcs[b]: the layer's caches of sequence b at KV head 0. Scratch: x (B hidden), q and out
 * (B n_heads hd), k and v (B n_kv hd), att (max_ctx), xq (B hidden/32 blocks), oq (B n_heads
 * hd/32 blocks). kv1 - kv0 heads' columns of wo must start on a block of wo's type. */
/* matmul, or for one token matvec, its own faster path (the same floats: see matmul) */
static inline void products(mat m, const int32_t *rows, int64_t start, int64_t n_rows, int64_t col0, int n,
                            const float *x, int64_t ldx, const q8blk *xq, int64_t ldq, int B, int fast, float *y,
                            int64_t ldy) {
    if (B == 1) matvec(m, rows, start, n_rows, col0, n, x, xq, fast, y);
    else matmul(m, rows, start, n_rows, col0, n, x, ldx, xq, ldq, B, fast, y, ldy);
}

static void attn_part(mat wq, const int32_t *q_rows, mat wk, const int32_t *k_rows, mat wv, mat wo,
                      const float *norm_w, float eps, int hidden, int n_heads, int n_kv, int hd, int d,
                      const float *cos_t, const float *sin_t, int B, const int64_t *pos, float *const *kcs,
                      float *const *vcs, int max_ctx, int fast, attn_scratch sc, const float *h, int kv0, int kv1,
                      float *part) {
    int group = n_heads / n_kv, lq = (kv1 - kv0) * group, lk = kv1 - kv0;
    int64_t nq = (int64_t)lq * hd, nk = (int64_t)lk * hd, q0 = (int64_t)kv0 * group * hd, k0 = (int64_t)kv0 * hd;
    int64_t ldxq = hidden / QK, ldoq = (nq + QK - 1) / QK, head_off = (int64_t)kv0 * max_ctx * hd;
    for (int b = 0; b < B; b++) {
        float *xb = sc.x + (int64_t)b * hidden;
        rms_norm_into(h + (int64_t)b * hidden, norm_w, eps, hidden, xb);
        if (fast) quantize_q8(xb, hidden, sc.xq + b * ldxq);
    }
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
    for (int b = 0; b < B; b++) {
        int p0 = (int)pos[b];
        attend(sc.q + b * nq, sc.k + b * nk, sc.v + b * nk, lq, lk, hd, d, cos_t + (int64_t)p0 * d,
               sin_t + (int64_t)p0 * d, p0, kcs[b] + head_off, vcs[b] + head_off, max_ctx, sc.att, sc.out + b * nq);
        if (fast) quantize_q8(sc.out + b * nq, (int)nq, sc.oq + b * ldoq);
    }
    products(wo, NULL, 0, hidden, q0, (int)nq, sc.out, nq, sc.oq, ldoq, B, fast, part, hidden);
}

/* attn_token for B sequences: every head's share (attn_part) added to the residual h in place. */
static void attn_batch(mat wq, const int32_t *q_rows, mat wk, const int32_t *k_rows, mat wv, mat wo,
                       const float *norm_w, float eps, int hidden, int n_heads, int n_kv, int hd, int d,
                       const float *cos_t, const float *sin_t, int B, const int64_t *pos, float *const *kcs,
                       float *const *vcs, int max_ctx, int fast, attn_scratch sc, float *h) {
    float *part = sc.x;  /* x: free once the products have read it (attn_part's last matmul reads out) */
    attn_part(wq, q_rows, wk, k_rows, wv, wo, norm_w, eps, hidden, n_heads, n_kv, hd, d, cos_t, sin_t, B, pos, kcs,
              vcs, max_ctx, fast, sc, h, 0, n_kv, part);
    for (int64_t i = 0; i < (int64_t)B * hidden; i++) h[i] += part[i];
}

/* One sequence's decoded token: attn_batch of one row (one token's products go through matvec) */
static void attn_token(mat wq, const int32_t *q_rows, mat wk, const int32_t *k_rows, mat wv, mat wo,
                       const float *norm_w, float eps, int hidden, int n_heads, int n_kv, int hd, int d,
                       const float *cos_t, const float *sin_t, int pos, float *kc, float *vc, int max_ctx,
                       int fast, attn_scratch sc, float *h) {
    int64_t p = pos;
    float *kcs[1] = {kc}, *vcs[1] = {vc};
    attn_batch(wq, q_rows, wk, k_rows, wv, wo, norm_w, eps, hidden, n_heads, n_kv, hd, d, cos_t, sin_t, 1, &p, kcs,
               vcs, max_ctx, fast, sc, h);
}

/* The file's values of row r's block in the X16 (group, block) at p, as the file's rows give them */
static void x16_dequant_block(int t, const uint8_t *p, int L, int r, float *o) {  /* L: lanes of p's run (16 but R16's tails) */
    float d = f16_to_f32(rd16(p + 2 * r)), d2 = t == X16 + T_Q4_1 || t == X16 + T_Q4_K ? f16_to_f32(rd16(p + 2 * L + 2 * r)) : 0.f;
    for (int v = 0; v < block_size(t - X16); v++) {
        int q = is_kquant(t - X16) ? x16_value(t, p, r, v) : run_value(t - X16, p, L, r, v);
        switch (t - X16) {
        case T_Q4_0: o[v] = d * (float)(q - 8); break;
        case T_Q4_1: o[v] = d * (float)q + d2; break;  /* d2: the min */
        case T_Q8_0: o[v] = d * (float)(q - 128); break;
        case T_Q4_K:  /* as kunpack: (d sc) q - dmin m */
            o[v] = d * (float)p[Q4K_SC(v / 32) + r] * (float)q - d2 * (float)p[Q4K_MN(v / 32) + r];
            break;
        default:  /* Q6_K, as kunpack: (d sc) (q - 32) */
            o[v] = d * (float)(int8_t)p[Q6_SC(v / 16) + r] * (float)(q - 32);
        }
    }
}

/* Dequantize rows (or a range) restricted to columns [col0, col0 + n) into out (n_rows x n) */
static void dequant_rows(mat m, const int32_t *rows, int64_t start, int64_t n_rows, int64_t col0, int n, float *out) {
    if (is_x16(m.t)) {  /* rows is NULL: X16 matrices take ranges on groups only */
        int t = m.t, bs = block_size(t - X16), gb = x16_block_bytes(t);
        for (int64_t i = 0; i < n_rows; i++) {
            int64_t row = start + i;
            const uint8_t *p = m.base + (row / 16) * m.stride + (col0 / bs) * gb;
            for (int k = 0; k < n / bs; k++, p += gb) x16_dequant_block(t, p, 16, (int)(row % 16), out + i * n + k * bs);
        }
        return;
    }
    if (is_r16(m.t)) {  /* block k of a row: lane k % 16 of its run k / 16 (whole rows: col0 0) */
        int gb = 16 * type_bytes(m.t), nb = n / QK;
        for (int64_t i = 0; i < n_rows; i++) {
            const uint8_t *w = row_at(m, rows ? rows[i] : start + i, 0);
            for (int k = 0; k < nb; k++)
                x16_dequant_block(m.t - R16 + X16, w + (k / 16) * gb, nb - k / 16 * 16 < 16 ? nb - k / 16 * 16 : 16, k % 16,
                                  out + i * n + k * QK);
        }
        return;
    }
    for (int64_t i = 0; i < n_rows; i++) {
        const uint8_t *w = row_at(m, rows ? rows[i] : start + i, col0);
        float *o = out + i * n;
        switch (m.t) {
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
        case T_Q4_K: case T_Q5_K: case T_Q6_K: {
            int8_t q[QKK];
            float scl[16], mn[16];
            for (int b = 0; b < n / QKK; b++, w += type_bytes(m.t), o += QKK) {
                int ss = kunpack(m.t, w, q, scl, mn);
                for (int l = 0; l < QKK; l++) o[l] = scl[l / ss] * (float)q[l] - mn[l / ss];  /* as gguf-py: (d sc) q - dmin m */
            }
            break;
        }
        }
    }
}

/* ---- Python entry points: pointers travel as integers, checked by the Python side ------------ */

static int get_mat(PyObject *const *a, mat *m) {  /* (ptr, stride, type) */
    m->base = (const uint8_t *)PyLong_AsVoidPtr(a[0]);
    m->stride = PyLong_AsLongLong(a[1]);
    m->t = (int)PyLong_AsLong(a[2]);
    if (PyErr_Occurred()) return -1;
    if (!type_bytes(m->t) && !is_x16(m->t)) { PyErr_Format(PyExc_ValueError, "unsupported tensor type %d", m->t); return -1; }
    return 0;
}

#define ARG_PTR(i) PyLong_AsVoidPtr(args[i])
#define ARG_LL(i) PyLong_AsLongLong(args[i])

/* matvec(ptr, stride, type, rows_ptr|0, start, n_rows, col0, n, x_ptr, fast, xq_ptr, y_ptr) */
static PyObject *py_matvec(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 12) { PyErr_SetString(PyExc_TypeError, "matvec takes 12 arguments"); return NULL; }
    mat m;
    if (get_mat(args, &m)) return NULL;
    const int32_t *rows = ARG_PTR(3);
    int64_t start = ARG_LL(4), n_rows = ARG_LL(5), col0 = ARG_LL(6);
    int n = (int)ARG_LL(7);
    const float *x = ARG_PTR(8);
    int fast = (int)ARG_LL(9);
    q8blk *xq = ARG_PTR(10);
    float *y = ARG_PTR(11);
    if (PyErr_Occurred()) return NULL;
    Py_BEGIN_ALLOW_THREADS
    if (fast && is_quant(m.t)) quantize_q8(x, n, xq);
    matvec(m, rows, start, n_rows, col0, n, x, xq, fast, y);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* The shard's arguments ffn_token and ffn_batch share: gate(3), up(3), down(3), down_t, hidden,
 * own0, n_own, act at args[0..13]; mask_ptr|0 and x_ptr at args[15], args[16]. */
typedef struct {
    mat g, u, d;
    int down_t, hidden, act;
    int64_t own0, n_own;
    const uint8_t *mask;
    const float *x;
} ffn_shard;

static int get_ffn_shard(PyObject *const *args, ffn_shard *f) {
    if (get_mat(args, &f->g) || get_mat(args + 3, &f->u) || get_mat(args + 6, &f->d)) return -1;
    f->down_t = (int)ARG_LL(9), f->hidden = (int)ARG_LL(10);
    f->own0 = ARG_LL(11), f->n_own = ARG_LL(12);
    f->act = (int)ARG_LL(13);
    f->mask = ARG_PTR(15);
    f->x = ARG_PTR(16);
    return PyErr_Occurred() ? -1 : 0;
}

static PyObject *ffn_result(int64_t n) {
    if (n == -1) return PyErr_NoMemory();
    if (n == -2) {
        PyErr_SetString(PyExc_ValueError, "interleaved gate/up rows take dense fast-mode steps only");
        return NULL;
    }
    return PyLong_FromLongLong(n);
}

/* ffn_token(<shard: 14>, threshold, mask_ptr|0, x_ptr, fast, h_ptr, xq_ptr, hq_ptr, y_ptr) -> n_active */
static PyObject *py_ffn_token(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 22) { PyErr_SetString(PyExc_TypeError, "ffn_token takes 22 arguments"); return NULL; }
    ffn_shard f;
    if (get_ffn_shard(args, &f)) return NULL;
    float threshold = (float)PyFloat_AsDouble(args[14]);
    int fast = (int)ARG_LL(17);
    float *h = ARG_PTR(18);
    q8blk *xq = ARG_PTR(19), *hq = ARG_PTR(20);
    float *y = ARG_PTR(21);
    if (PyErr_Occurred()) return NULL;
    int64_t n_active;
    Py_BEGIN_ALLOW_THREADS
    n_active = ffn_token(f.g, f.u, f.d, f.down_t, f.hidden, f.own0, f.n_own, f.act, threshold, f.mask, f.x, fast, h,
                         xq, hq, y);
    Py_END_ALLOW_THREADS
    return ffn_result(n_active);
}

/* matmul(ptr, stride, type, rows_ptr|0, start, n_rows, col0, n, x_ptr, ldx, B, fast, xq_ptr, y_ptr, ldy):
 * xq: room for B (n/32 rounded up) q8 blocks */
static PyObject *py_matmul(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 15) { PyErr_SetString(PyExc_TypeError, "matmul takes 15 arguments"); return NULL; }
    mat m;
    if (get_mat(args, &m)) return NULL;
    const int32_t *rows = ARG_PTR(3);
    int64_t start = ARG_LL(4), n_rows = ARG_LL(5), col0 = ARG_LL(6);
    int n = (int)ARG_LL(7);
    const float *x = ARG_PTR(8);
    int64_t ldx = ARG_LL(9);
    int B = (int)ARG_LL(10), fast = (int)ARG_LL(11);
    q8blk *xq = ARG_PTR(12);
    float *y = ARG_PTR(13);
    int64_t ldy = ARG_LL(14);
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

/* ffn_batch(<shard: 14>, thr_ptr|0, mask_ptr|0, x_ptr, B, fast, h_ptr, any_ptr, xq_ptr, hq_ptr,
 *           counts_ptr, y_ptr) -> active (neuron, token) pairs */
static PyObject *py_ffn_batch(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 25) { PyErr_SetString(PyExc_TypeError, "ffn_batch takes 25 arguments"); return NULL; }
    ffn_shard f;
    if (get_ffn_shard(args, &f)) return NULL;
    const float *thr = ARG_PTR(14);
    int B = (int)ARG_LL(17), fast = (int)ARG_LL(18);
    float *h = ARG_PTR(19);
    uint8_t *any = ARG_PTR(20);
    q8blk *xq = ARG_PTR(21), *hq = ARG_PTR(22);
    int64_t *counts = ARG_PTR(23);
    float *y = ARG_PTR(24);
    if (PyErr_Occurred()) return NULL;
    if (B < 1 || B > MAXB) { PyErr_Format(PyExc_ValueError, "ffn_batch: %d tokens, at most %d", B, MAXB); return NULL; }
    int64_t n_active;
    Py_BEGIN_ALLOW_THREADS
    n_active = ffn_batch(f.g, f.u, f.d, f.down_t, f.hidden, f.own0, f.n_own, f.act, thr, f.mask, f.x, B, fast, h, any,
                         xq, hq, counts, y);
    Py_END_ALLOW_THREADS
    return ffn_result(n_active);
}

/* dequant(ptr, stride, type, rows_ptr|0, start, n_rows, col0, n, out_ptr) */
static PyObject *py_dequant(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 9) { PyErr_SetString(PyExc_TypeError, "dequant takes 9 arguments"); return NULL; }
    mat m;
    if (get_mat(args, &m)) return NULL;
    const int32_t *rows = ARG_PTR(3);
    int64_t start = ARG_LL(4), n_rows = ARG_LL(5), col0 = ARG_LL(6);
    int n = (int)ARG_LL(7);
    float *out = ARG_PTR(8);
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
 * n_blocks blocks of 16 rows (Q4_0, Q4_1, Q8_0, Q4_K or Q6_K); interleave_blocks, the same
 * arguments: dst holds the rows, each row's blocks in runs of 16 (Q4_0, Q4_1 or Q8_0) */
static PyObject *repack(PyObject *const *args, Py_ssize_t nargs, int blocks) {
    const char *name = blocks ? "interleave_blocks" : "interleave";
    if (nargs != 6) { PyErr_Format(PyExc_TypeError, "%s takes 6 arguments", name); return NULL; }
    const uint8_t *src = ARG_PTR(0);
    int64_t stride = ARG_LL(1), rows = ARG_LL(3);
    int t = (int)ARG_LL(2), nb = (int)ARG_LL(4);
    uint8_t *dst = ARG_PTR(5);
    if (PyErr_Occurred()) return NULL;
    if (t != T_Q4_0 && t != T_Q4_1 && t != T_Q8_0 && (blocks || (t != T_Q6_K && t != T_Q4_K))) {
        PyErr_Format(PyExc_ValueError, "%s: %s only", name, blocks ? "Q4_0, Q4_1 or Q8_0" : "Q4_0, Q4_1, Q8_0, Q4_K or Q6_K");
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
    return PyUnicode_FromString(use_vnni ? "avx512vnni" : use_avx2 ? "avx2" : "generic");
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
#endif

/* "avx512vnni" (fast mode's integer dots with VNNI, AVX2 elsewhere), "avx2" or "generic" (the
 * portable path), each where the CPU has it, else the next one down */
static PyObject *py_set_isa(PyObject *self, PyObject *arg) {
    const char *s = PyUnicode_AsUTF8(arg);
    if (!s) return NULL;
#if HAVE_X86
    use_vnni = strcmp(s, "avx512vnni") == 0 && cpu_vnni();
    use_avx2 = (use_vnni || strcmp(s, "avx2") == 0 || strcmp(s, "avx512vnni") == 0) && cpu_avx2();
#endif
    return py_isa(self, NULL);
}

/* The attention layer's arguments attn_token and attn_batch share, args[0..22]:
 * q(3), q_rows, k(3), k_rows, v(3), o(3), norm_w, eps, hidden, n_heads, n_kv, hd, d, cos_ptr, sin_ptr */
typedef struct {
    mat wq, wk, wv, wo;
    const int32_t *q_rows, *k_rows;
    const float *norm_w, *cos_r, *sin_r;
    float eps;
    int hidden, n_heads, n_kv, hd, d;
} attn_layer;

static int get_attn_layer(PyObject *const *args, attn_layer *L) {
    if (get_mat(args, &L->wq) || get_mat(args + 4, &L->wk) || get_mat(args + 8, &L->wv) || get_mat(args + 11, &L->wo))
        return -1;
    L->q_rows = ARG_PTR(3), L->k_rows = ARG_PTR(7);
    L->norm_w = ARG_PTR(14);
    L->eps = (float)PyFloat_AsDouble(args[15]);
    L->hidden = (int)ARG_LL(16), L->n_heads = (int)ARG_LL(17), L->n_kv = (int)ARG_LL(18);
    L->hd = (int)ARG_LL(19), L->d = (int)ARG_LL(20);
    L->cos_r = ARG_PTR(21), L->sin_r = ARG_PTR(22);
    if (PyErr_Occurred()) return -1;
    if (L->d > 1024 || L->d > L->hd || L->n_kv <= 0 || L->n_heads % L->n_kv) {
        PyErr_SetString(PyExc_ValueError, "attention: bad head or rope arguments");
        return -1;
    }
    return 0;
}

/* attn_token(<attn layer: 23>, pos, k_cache_ptr, v_cache_ptr, max_ctx, fast,
 *            x, q, k, v, att, out, xq, oq, h): 37 arguments; cos/sin: the whole tables */
static PyObject *py_attn_token(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 37) { PyErr_SetString(PyExc_TypeError, "attn_token takes 37 arguments"); return NULL; }
    attn_layer L;
    if (get_attn_layer(args, &L)) return NULL;
    int pos = (int)ARG_LL(23);
    float *kc = ARG_PTR(24), *vc = ARG_PTR(25);
    int max_ctx = (int)ARG_LL(26), fast = (int)ARG_LL(27);
    attn_scratch sc = {ARG_PTR(28), ARG_PTR(29), ARG_PTR(30), ARG_PTR(31), ARG_PTR(32), ARG_PTR(33), ARG_PTR(34), ARG_PTR(35)};
    float *h = ARG_PTR(36);
    if (PyErr_Occurred()) return NULL;
    if (pos < 0 || pos >= max_ctx) { PyErr_SetString(PyExc_ValueError, "attn_token: position outside the cache"); return NULL; }
    Py_BEGIN_ALLOW_THREADS
    attn_token(L.wq, L.q_rows, L.wk, L.k_rows, L.wv, L.wo, L.norm_w, L.eps, L.hidden, L.n_heads, L.n_kv, L.hd, L.d,
               L.cos_r, L.sin_r, pos, kc, vc, max_ctx, fast, sc, h);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* attn_batch(<attn layer: 23, cos/sin: the whole tables>, B, pos_ptr (B int64), k_cache_ptrs (B int64),
 *            v_cache_ptrs, max_ctx, fast, x, q, k, v, att, out, xq, oq, h): 38 arguments */
static PyObject *py_attn_batch(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 38) { PyErr_SetString(PyExc_TypeError, "attn_batch takes 38 arguments"); return NULL; }
    attn_layer L;
    if (get_attn_layer(args, &L)) return NULL;
    int B = (int)ARG_LL(23);
    const int64_t *pos = ARG_PTR(24);
    float *const *kcs = ARG_PTR(25), *const *vcs = ARG_PTR(26);
    int max_ctx = (int)ARG_LL(27), fast = (int)ARG_LL(28);
    attn_scratch sc = {ARG_PTR(29), ARG_PTR(30), ARG_PTR(31), ARG_PTR(32), ARG_PTR(33), ARG_PTR(34), ARG_PTR(35), ARG_PTR(36)};
    float *h = ARG_PTR(37);
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

/* attn_part(<attn_batch's 38 arguments, h read only>, kv0, kv1, part_ptr (B x hidden)): 41 arguments */
static PyObject *py_attn_part(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 41) { PyErr_SetString(PyExc_TypeError, "attn_part takes 41 arguments"); return NULL; }
    attn_layer L;
    if (get_attn_layer(args, &L)) return NULL;
    int B = (int)ARG_LL(23);
    const int64_t *pos = ARG_PTR(24);
    float *const *kcs = ARG_PTR(25), *const *vcs = ARG_PTR(26);
    int max_ctx = (int)ARG_LL(27), fast = (int)ARG_LL(28);
    attn_scratch sc = {ARG_PTR(29), ARG_PTR(30), ARG_PTR(31), ARG_PTR(32), ARG_PTR(33), ARG_PTR(34), ARG_PTR(35), ARG_PTR(36)};
    const float *h = ARG_PTR(37);
    int kv0 = (int)ARG_LL(38), kv1 = (int)ARG_LL(39);
    float *part = ARG_PTR(40);
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
    {"interleave", (PyCFunction)(void (*)(void))py_interleave, METH_FASTCALL, "Q4_0/Q4_1/Q8_0 rows, 16 side by side"},
    {"interleave_blocks", (PyCFunction)(void (*)(void))py_interleave_blocks, METH_FASTCALL, "each row's blocks, 16 side by side"},
    {"quantize_q8", (PyCFunction)(void (*)(void))py_quantize_q8, METH_FASTCALL, "8-bit activation blocks"},
    {"residual_norm", (PyCFunction)(void (*)(void))py_residual_norm, METH_FASTCALL, "h += shares; x = norm(h)"},
    {"isa", py_isa, METH_NOARGS, "the instruction set in use"},
    {"set_isa", py_set_isa, METH_O, "use 'avx512vnni' or 'avx2' (where supported) or 'generic'"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels", NULL, -1, methods};

PyMODINIT_FUNC PyInit__kernels(void) {
#if HAVE_X86
    use_avx2 = cpu_avx2();
    use_vnni = cpu_vnni();
#endif
    return PyModule_Create(&module);
}
