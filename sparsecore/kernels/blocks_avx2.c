/* simd_avx2.c (and simd_avx512.c, for its helpers), part:
 * the file's block formats with AVX2 (+FMA, F16C): one row's exact and fast dots
 * and axpy, the same for several tokens per row (Q2_K and Q3_K: their own kernels, k23_*), and
 * the activations' quantization. Q5_0, Q5_1, IQ4_NL, IQ4_XS, IQ3_XXS and IQ3_S have their dots in the
 * several-token kernels only (the one-token dots call them with one token): the codebook
 * types' values by pshufb, Q5's fifth bits by a byte compare. */

/* ---- dot products, AVX2 -------------------------------------------------------------------- */
#if HAVE_X86
/* f16_to_f32 in one instruction (F16C: exact, as the portable conversion; the axpy and dot
 * loops of one-row products converted a scale per block, some 20 instructions each) */
AVX2 static inline float f16c_f32(uint16_t h) { return _cvtsh_ss(h); }
/* 8 BF16 values as floats: each the upper half of its float32 (exact, as bf16_to_f32) */
AVX2 static inline __m256 bf16x8_f32(const uint8_t *w) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)w)), 16));
}

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

/* Q5_0's and Q5_1's fifth bits: the 32 bits at qh as 32 bytes, 16 where value j's bit is set
 * (byte j gets qh's byte j / 8, then each keeps its own bit) */
AVX2 static inline __m256i bits16(const uint8_t *qh) {
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32(rd32(qh)), _mm256_setr_epi64x(0, 0x0101010101010101LL,
                                                                                    0x0202020202020202LL, 0x0303030303030303LL));
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit), _mm256_set1_epi8(16));
}
/* IQ4_NL's codebook in both 128-bit lanes, for pshufb */
AVX2 static inline __m256i kvalues256(void) { return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)kvalues_iq4nl)); }
/* 32 nibbles at qs (Q4_0's order) looked up in the codebook: 32 signed values */
AVX2 static inline __m256i iq4_values(const uint8_t *qs) { return _mm256_shuffle_epi8(kvalues256(), nibbles(qs)); }
/* IQ4_XS: two consecutive sub-blocks' 32 bytes of nibbles at qs looked up in the codebook, as
 * *q0 and *q1 (one load, one shift for both; the halves swapped in place by two permutes) */
AVX2 static inline void iq4_values2(const uint8_t *qs, __m256i *q0, __m256i *q1) {
    const __m256i m4 = _mm256_set1_epi8(15), kv = kvalues256();
    __m256i v = _mm256_loadu_si256((const __m256i *)qs);
    __m256i lo = _mm256_shuffle_epi8(kv, _mm256_and_si256(v, m4)), hi = _mm256_shuffle_epi8(kv, _mm256_and_si256(_mm256_srli_epi16(v, 4), m4));
    *q0 = _mm256_permute2x128_si256(lo, hi, 0x20);
    *q1 = _mm256_permute2x128_si256(lo, hi, 0x31);
}
/* MXFP4's codebook (the E2M1 values doubled) in both 128-bit lanes, for pshufb */
AVX2 static inline __m256i mxfp4_values(const uint8_t *qs) {
    return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)kvalues_mxfp4)), nibbles(qs));
}
/* A Q5_0, Q5_1, IQ4_NL or MXFP4 block's 32 values as 32 bytes (unpack32's order): Q5_0 and Q5_1
 * q unsigned (0..31, Q5_0's before its -16), IQ4_NL and MXFP4 their codebook's (signed) */
AVX2 static inline __m256i q32_values(int t, const uint8_t *w) {
    if (t == T_IQ4_NL) return iq4_values(w + 2);
    if (t == T_MXFP4) return mxfp4_values(w + 1);
    int off = t == T_Q5_1 ? 4 : 2;
    return _mm256_or_si256(nibbles(w + off + 4), bits16(w + off));
}
/* IQ4_XS: each sub-block's scale d (ls - 32) in lanes 0..7: ls's low 4 bits are nibble j of the
 * word scales_l, its high 2 bits 2j..2j+1 of scales_h */
AVX2 static inline __m256 iq4xs_scales(const uint8_t *w) {
    __m256i lo = _mm256_srlv_epi32(_mm256_set1_epi32(rd32(w + 4)), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28));
    __m256i hi = _mm256_srlv_epi32(_mm256_set1_epi32(rd16(w + 2)), _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14));
    __m256i ls = _mm256_or_si256(_mm256_and_si256(lo, _mm256_set1_epi32(15)), _mm256_slli_epi32(_mm256_and_si256(hi, _mm256_set1_epi32(3)), 4));
    return _mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(rd16(w))), _mm256_cvtepi32_ps(_mm256_sub_epi32(ls, _mm256_set1_epi32(32))));
}

/* IQ3_XXS and IQ3_S, AVX2: sub-block j's 32 grid values unsigned (8 grid words by index, one
 * vpgatherdd: 8 scalar loads into _mm256_set_epi32, as llama.cpp, took as long for IQ3_XXS and
 * 1.1x for IQ3_S; through a stack buffer 1.4x) and its signs as 32 bytes +1 / -1, for
 * _mm256_sign_epi8 (a grid value is never 0: the signed value is sign_epi8(g, s), and a token's x
 * times s with g unsigned is the unsigned-by-signed product maddubs takes, 2 x 62 x 127 < 32767).
 * IQ3_XXS's 7-bit sign indices read their 8 signs from a table of 128 8-byte words (ksigns_iq3's
 * bits as +1 / -1 bytes); IQ3_S's 32 sign bits become bytes by bits16's shuffle and compare. */
static const uint64_t iq3xxs_signs8[128] = {
    0x0101010101010101ULL, 0xff010101010101ffULL, 0xff0101010101ff01ULL, 0x010101010101ffffULL,
    0xff01010101ff0101ULL, 0x0101010101ff01ffULL, 0x0101010101ffff01ULL, 0xff01010101ffffffULL,
    0xff010101ff010101ULL, 0x01010101ff0101ffULL, 0x01010101ff01ff01ULL, 0xff010101ff01ffffULL,
    0x01010101ffff0101ULL, 0xff010101ffff01ffULL, 0xff010101ffffff01ULL, 0x01010101ffffffffULL,
    0xff0101ff01010101ULL, 0x010101ff010101ffULL, 0x010101ff0101ff01ULL, 0xff0101ff0101ffffULL,
    0x010101ff01ff0101ULL, 0xff0101ff01ff01ffULL, 0xff0101ff01ffff01ULL, 0x010101ff01ffffffULL,
    0x010101ffff010101ULL, 0xff0101ffff0101ffULL, 0xff0101ffff01ff01ULL, 0x010101ffff01ffffULL,
    0xff0101ffffff0101ULL, 0x010101ffffff01ffULL, 0x010101ffffffff01ULL, 0xff0101ffffffffffULL,
    0xff01ff0101010101ULL, 0x0101ff01010101ffULL, 0x0101ff010101ff01ULL, 0xff01ff010101ffffULL,
    0x0101ff0101ff0101ULL, 0xff01ff0101ff01ffULL, 0xff01ff0101ffff01ULL, 0x0101ff0101ffffffULL,
    0x0101ff01ff010101ULL, 0xff01ff01ff0101ffULL, 0xff01ff01ff01ff01ULL, 0x0101ff01ff01ffffULL,
    0xff01ff01ffff0101ULL, 0x0101ff01ffff01ffULL, 0x0101ff01ffffff01ULL, 0xff01ff01ffffffffULL,
    0x0101ffff01010101ULL, 0xff01ffff010101ffULL, 0xff01ffff0101ff01ULL, 0x0101ffff0101ffffULL,
    0xff01ffff01ff0101ULL, 0x0101ffff01ff01ffULL, 0x0101ffff01ffff01ULL, 0xff01ffff01ffffffULL,
    0xff01ffffff010101ULL, 0x0101ffffff0101ffULL, 0x0101ffffff01ff01ULL, 0xff01ffffff01ffffULL,
    0x0101ffffffff0101ULL, 0xff01ffffffff01ffULL, 0xff01ffffffffff01ULL, 0x0101ffffffffffffULL,
    0xffff010101010101ULL, 0x01ff0101010101ffULL, 0x01ff01010101ff01ULL, 0xffff01010101ffffULL,
    0x01ff010101ff0101ULL, 0xffff010101ff01ffULL, 0xffff010101ffff01ULL, 0x01ff010101ffffffULL,
    0x01ff0101ff010101ULL, 0xffff0101ff0101ffULL, 0xffff0101ff01ff01ULL, 0x01ff0101ff01ffffULL,
    0xffff0101ffff0101ULL, 0x01ff0101ffff01ffULL, 0x01ff0101ffffff01ULL, 0xffff0101ffffffffULL,
    0x01ff01ff01010101ULL, 0xffff01ff010101ffULL, 0xffff01ff0101ff01ULL, 0x01ff01ff0101ffffULL,
    0xffff01ff01ff0101ULL, 0x01ff01ff01ff01ffULL, 0x01ff01ff01ffff01ULL, 0xffff01ff01ffffffULL,
    0xffff01ffff010101ULL, 0x01ff01ffff0101ffULL, 0x01ff01ffff01ff01ULL, 0xffff01ffff01ffffULL,
    0x01ff01ffffff0101ULL, 0xffff01ffffff01ffULL, 0xffff01ffffffff01ULL, 0x01ff01ffffffffffULL,
    0x01ffff0101010101ULL, 0xffffff01010101ffULL, 0xffffff010101ff01ULL, 0x01ffff010101ffffULL,
    0xffffff0101ff0101ULL, 0x01ffff0101ff01ffULL, 0x01ffff0101ffff01ULL, 0xffffff0101ffffffULL,
    0xffffff01ff010101ULL, 0x01ffff01ff0101ffULL, 0x01ffff01ff01ff01ULL, 0xffffff01ff01ffffULL,
    0x01ffff01ffff0101ULL, 0xffffff01ffff01ffULL, 0xffffff01ffffff01ULL, 0x01ffff01ffffffffULL,
    0xffffffff01010101ULL, 0x01ffffff010101ffULL, 0x01ffffff0101ff01ULL, 0xffffffff0101ffffULL,
    0x01ffffff01ff0101ULL, 0xffffffff01ff01ffULL, 0xffffffff01ffff01ULL, 0x01ffffff01ffffffULL,
    0x01ffffffff010101ULL, 0xffffffffff0101ffULL, 0xffffffffff01ff01ULL, 0x01ffffffff01ffffULL,
    0xffffffffffff0101ULL, 0x01ffffffffff01ffULL, 0x01ffffffffffff01ULL, 0xffffffffffffffffULL,
};
AVX2 static INLINE __m256i iq3_grid8(int t, const uint8_t *w, int j) {
    __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(w + 2 + 8 * j)));
    if (t == T_IQ3_S) {
        idx = _mm256_or_si256(idx, _mm256_and_si256(_mm256_sllv_epi32(_mm256_set1_epi32(w[66 + j]), _mm256_setr_epi32(8, 7, 6, 5, 4, 3, 2, 1)),
                                                    _mm256_set1_epi32(256)));
        return _mm256_i32gather_epi32((const int *)iq3s_grid, idx, 4);
    }
    return _mm256_i32gather_epi32((const int *)iq3xxs_grid, idx, 4);
}
AVX2 static INLINE __m256i iq3_signs8(int t, const uint8_t *w, int j) {
    if (t == T_IQ3_S) {
        __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32(rd32(w + 74 + 4 * j)),
                                        _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL, 0x0303030303030303LL));
        const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
        return _mm256_or_si256(_mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit), _mm256_set1_epi8(1));
    }
    uint32_t a = (uint32_t)rd32(w + 66 + 4 * j);
    return _mm256_setr_epi64x((long long)iq3xxs_signs8[a & 127], (long long)iq3xxs_signs8[(a >> 7) & 127],
                              (long long)iq3xxs_signs8[(a >> 14) & 127], (long long)iq3xxs_signs8[(a >> 21) & 127]);
}
/* each sub-block's scale in lanes 0..7, as iq3_scale (the same float operations) */
AVX2 static inline __m256 iq3_scales(int t, const uint8_t *w) {
    __m256 d = _mm256_set1_ps(_cvtsh_ss(rd16(w)));
    if (t == T_IQ3_S) {
        __m256i ls = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(rd32(w + 106)), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
                                      _mm256_set1_epi32(15));
        return _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_add_epi32(ls, ls), _mm256_set1_epi32(1))));
    }
    __m256i a = _mm256_srli_epi32(_mm256_loadu_si256((const __m256i *)(w + 66)), 28);
    __m256 h = _mm256_set1_ps(0.5f);
    return _mm256_mul_ps(_mm256_mul_ps(d, _mm256_add_ps(h, _mm256_cvtepi32_ps(a))), h);
}

/* the several-token kernels (below): the one-token dots of Q5_0, Q5_1, IQ4_NL, IQ4_XS, IQ3_XXS
 * and IQ3_S */
AVX2 static INLINE void dots_exact_tile(int t, const uint8_t *w, const float *x, int64_t ldx, int n, int B, float *y, int64_t ldy);
AVX2 static INLINE void dots_fast_tile(int t, const uint8_t *w, const q8blk *xq, int64_t ldq, int nb, int B, float *y, int64_t ldy);
/* Q2_K and Q3_K's one-row kernels: below, with the helpers they share with the batch tiles */
AVX2 static float dot_exact_k23(int t, const uint8_t *w, const float *x, int n);
AVX2 static void axpy_k23(int t, const uint8_t *w, float a, float *y, int n);

/* 8 F16 or BF16 values (t) as floats, and one: every conversion exact */
AVX2 static INLINE __m256 half8_f32(int t, const uint8_t *w) {
    return t == T_F16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)w)) : bf16x8_f32(w);
}
AVX2 static INLINE float half1_f32(int t, const uint8_t *w) {
    return t == T_F16 ? f16c_f32(rd16(w)) : bf16_to_f32(rd16(w));
}

/* A row of n F16 or BF16 values (t, a constant in its callers: the kernel table's dequant
 * entries) as float32, as dequant_row gives them: the tiles a prompt's GEMM reads. The portable
 * loop converts F16 bit by bit: a 1.1B-shape F16 file's 32-token prompt spent most of its time
 * there. */
AVX2 static INLINE void half_row_avx2(int t, const uint8_t *w, int n, float *o) {
    int i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(o + i, half8_f32(t, w + 2 * i));
    for (; i < n; i++) o[i] = half1_f32(t, w + 2 * i);
}

/* One token's F16 or BF16 row dot (t): four chains (of every 32 values, 8 to each), added
 * pairwise before the sum. One chain is bound by the FMA's latency: F16's read 12.2 GB/s a core
 * that way (5632 x 2048 from memory), and BF16 had only the portable loop at every level, 1.9
 * GB/s; four read 22-25 GB/s (docs/KERNELS.md). Several tokens call it in turn while the row is
 * in L1 (dots_exact_avx2), so a token's result does not depend on its batch. */
AVX2 static INLINE float dot_half_avx2(int t, const uint8_t *w, const float *x, int n) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int i = 0;
    for (; i + 32 <= n; i += 32) {
        a0 = _mm256_fmadd_ps(half8_f32(t, w + 2 * i), _mm256_loadu_ps(x + i), a0);
        a1 = _mm256_fmadd_ps(half8_f32(t, w + 2 * i + 16), _mm256_loadu_ps(x + i + 8), a1);
        a2 = _mm256_fmadd_ps(half8_f32(t, w + 2 * i + 32), _mm256_loadu_ps(x + i + 16), a2);
        a3 = _mm256_fmadd_ps(half8_f32(t, w + 2 * i + 48), _mm256_loadu_ps(x + i + 24), a3);
    }
    for (; i + 8 <= n; i += 8) a0 = _mm256_fmadd_ps(half8_f32(t, w + 2 * i), _mm256_loadu_ps(x + i), a0);
    float r = hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    for (; i < n; i++) r += half1_f32(t, w + 2 * i) * x[i];
    return r;
}

AVX2 static INLINE float dot_exact_avx2(int t, const uint8_t *w, const float *x, int n) {
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
    case T_Q2_K: case T_Q3_K:
        return dot_exact_k23(t, w, x, n);
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
    case T_F16: case T_BF16:
        return dot_half_avx2(t, w, x, n);
    case T_Q5_0: case T_Q5_1: case T_IQ4_NL: case T_MXFP4: case T_IQ4_XS: case T_IQ3_XXS: case T_IQ3_S: {  /* the batch kernel's one-token case */
        float y;
        dots_exact_tile(t, w, x, 0, n, 1, &y, 0);
        return y;
    }
    default:
        return dot_exact_c(t, w, x, n);
    }
}

/* unsigned bytes u (0..127 or 0..15) times signed bytes s, summed to 8 int32 lanes */
AVX2 static inline __m256i dot_u8s8(__m256i u, __m256i s) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

AVX2 static INLINE float dot_fast_avx2(int t, const uint8_t *w, const q8blk *xq, int nb) {
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
    case T_Q5_0: case T_Q5_1: case T_IQ4_NL: case T_MXFP4: case T_IQ4_XS: case T_IQ3_XXS: case T_IQ3_S: {  /* the batch kernel's one-token case */
        float y;
        dots_fast_tile(t, w, xq, 0, nb, 1, &y, 0);
        return y;
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

AVX2 static INLINE void axpy_avx2(int t, const uint8_t *w, float a, float *y, int n) {
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
    case T_Q5_0: case T_Q5_1: case T_IQ4_NL: case T_MXFP4: {
        const __m256i off = _mm256_set1_epi8(t == T_Q5_0 ? 16 : 0);
        for (int b = 0; b < n / QK; b++, w += type_bytes(t), y += QK)
            i8x32_axpy(_mm256_sub_epi8(q32_values(t, w), off), y, _mm256_set1_ps(a * q32_d(t, w)),
                       t == T_Q5_1 ? _mm256_set1_ps(a * f16c_f32(rd16(w + 2))) : zero);
        return;
    }
    case T_IQ4_XS: {
        float scl[8];
        for (int b = 0; b < n / QKK; b++, w += 136) {
            _mm256_storeu_ps(scl, iq4xs_scales(w));
            for (int j = 0; j < 8; j++, y += QK) i8x32_axpy(iq4_values(w + 8 + 16 * j), y, _mm256_set1_ps(a * scl[j]), zero);
        }
        return;
    }
    case T_IQ3_XXS: case T_IQ3_S: {
        float scl[8];
        for (int b = 0; b < n / QKK; b++, w += type_bytes(t)) {
            _mm256_storeu_ps(scl, iq3_scales(t, w));
            for (int j = 0; j < 8; j++, y += QK)
                i8x32_axpy(_mm256_sign_epi8(iq3_grid8(t, w, j), iq3_signs8(t, w, j)), y, _mm256_set1_ps(a * scl[j]), zero);
        }
        return;
    }
    case T_Q2_K: case T_Q3_K:
        axpy_k23(t, w, a, y, n);
        return;
    case T_F32: {
        const float *f = (const float *)w;
        int i = 0;
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(y + i, _mm256_fmadd_ps(_mm256_loadu_ps(f + i), _mm256_set1_ps(a), _mm256_loadu_ps(y + i)));
        for (; i < n; i++) y[i] += a * f[i];
        return;
    }
    case T_F16: case T_BF16: {
        const __m256 av = _mm256_set1_ps(a);
        int i = 0;
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(y + i, _mm256_fmadd_ps(half8_f32(t, w + 2 * i), av, _mm256_loadu_ps(y + i)));
        for (; i < n; i++) y[i] += a * half1_f32(t, w + 2 * i);
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

/* ---- Q2_K and Q3_K, AVX2 --------------------------------------------------------------------
 * Sub-blocks of 16 values, two per q8 block, as Q6_K's. The values unsigned, as maddubs takes
 * them: Q2_K's q (0..3), Q3_K's q + 4 (0..7). Fast mode, per q8 block: both sub-blocks' integer
 * dots times their integer scales (madd), one conversion and one FMA with x's scale; the
 * offsets the unsigned values leave (Q2_K's min, Q3_K's -4, per sub-block: times the sum of x
 * over its 16 values) once per block of 256 in a few vector operations, from each token's sums
 * x_d (sum of q over each 16) made once per product (k23_pack, from pack_x): computed per q8
 * block they took more instructions than the dots. One row is the tile of one token: a
 * token's floats do not depend on its batch. */

/* Per token, its sums of each 16 q8 values times their block's scale: 2 nb floats, in xpair
 * units of 16 floats (pack_x's buffer) */
static inline int64_t k23_ld(int nb) { return (nb + 7) / 8; }
static void k23_pack(const q8blk *xq, int64_t ldq, int nb, int B, xpair *out) {
    for (int b = 0; b < B; b++) {
        float *xs = (float *)(out + b * k23_ld(nb));
        const q8blk *x = xq + b * ldq;
        for (int k = 0; k < nb; k++) {
            int32_t s0 = 0, s1 = 0;
            for (int l = 0; l < 16; l++) s0 += x[k].q[l], s1 += x[k].q[16 + l];
            xs[2 * k] = x[k].d * (float)s0;
            xs[2 * k + 1] = x[k].d * (float)s1;
        }
    }
}

/* q8 block i (values 32 i ..+32) of a Q2_K or Q3_K block, unsigned: from qs's 32 bytes v of its
 * half, and Q3_K's hmask hm (bit i, set: no -4) */
AVX2 static INLINE __m256i k23_q(int t, __m256i v, __m256i hm, int i) {
    __m256i q = _mm256_and_si256(i & 3 ? _mm256_srli_epi16(v, 2 * (i & 3)) : v, _mm256_set1_epi8(3));
    if (t == T_Q3_K) {  /* bit i to bit 2: q + 4 (a shift of 16 bits moves no other byte's bit to bit 2 here) */
        __m256i b = i < 2 ? _mm256_slli_epi16(hm, 2 - i) : i > 2 ? _mm256_srli_epi16(hm, i - 2) : hm;
        q = _mm256_or_si256(q, _mm256_and_si256(b, _mm256_set1_epi8(4)));
    }
    return q;
}

/* the 16 scales as int8 (Q2_K 0..15, Q3_K sc - 32), and Q2_K's 16 mins (0..15) */
AVX2 static INLINE __m128i k23_scales(int t, const uint8_t *w, __m128i *mins) {
    if (t == T_Q2_K) {
        __m128i s = _mm_loadu_si128((const __m128i *)w), m4 = _mm_set1_epi8(15);
        *mins = _mm_and_si128(_mm_srli_epi16(s, 4), m4);
        return _mm_and_si128(s, m4);
    }
    /* Q3_K: words a0 = bytes 0..3, a1 = 4..7 hold the low 4 bits (scales 0..7 low nibbles, 8..15
     * high), a2 = bytes 8..11 the high 2 (scales 4 r .. 4 r + 3 at bits 2 r) */
    uint32_t a0, a1, a2;
    memcpy(&a0, w + 96, 4), memcpy(&a1, w + 100, 4), memcpy(&a2, w + 104, 4);
    const uint32_t m4 = 0x0f0f0f0fu, m2 = 0x03030303u;
    __m128i s = _mm_set_epi32((int)(((a1 >> 4) & m4) | (((a2 >> 6) & m2) << 4)), (int)(((a0 >> 4) & m4) | (((a2 >> 4) & m2) << 4)),
                              (int)((a1 & m4) | (((a2 >> 2) & m2) << 4)), (int)((a0 & m4) | ((a2 & m2) << 4)));
    *mins = _mm_setzero_si128();
    return _mm_sub_epi8(s, _mm_set1_epi8(32));
}

/* 16 int8 as floats, lanes 0..7 and 8..15 */
AVX2 static INLINE void i8x16_to_f(__m128i v, __m256 *lo, __m256 *hi) {
    *lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
    *hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8)));
}

/* Fast mode, B tokens (constant: a tile's accumulators in registers) against one row of nb q8
 * blocks: token b's q8 blocks at xq + b ldq, its sums (k23_pack) at xs + b ldxs. Per block of
 * 256 and token: even and odd q8 blocks in two sums (the FMA latency), their total less the
 * offsets, times d (Q3_K: d (p - 4 sum sc x)); Q2_K less dmin sum m x. */
AVX2 static INLINE void k23_fast_tile(int t, const uint8_t *w, const q8blk *xq, int64_t ldq, const float *xs, int64_t ldxs,
                                      int nb, int B, float *y, int64_t ldy) {
    __m256 acc[TILE];
    for (int b = 0; b < B; b++) acc[b] = _mm256_setzero_ps();
    const int bytes = type_bytes(t), qs_at = t == T_Q2_K ? 16 : 32;
    /* the 16 scales in int16, the even sub-blocks' in the low 128 bits and the odd ones' in the
     * high: one shuffle then gives each q8 block's pair, one scale per 128-bit half */
    const __m128i even_odd = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    for (int k = 0; k < nb / 8; k++, w += bytes) {
        __m128i mn8, sc8 = k23_scales(t, w, &mn8);
        __m256i s16 = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc8, even_odd));
        __m256 o_lo, o_hi;  /* the offsets' factors: Q2_K's mins, Q3_K's scales */
        i8x16_to_f(t == T_Q2_K ? mn8 : sc8, &o_lo, &o_hi);
        __m256 d = _mm256_set1_ps(f16c_f32(rd16(w + (t == T_Q2_K ? 80 : 108))));
        __m256i v[2] = {_mm256_loadu_si256((const __m256i *)(w + qs_at)), _mm256_loadu_si256((const __m256i *)(w + qs_at + 32))};
        __m256i hm = t == T_Q3_K ? _mm256_loadu_si256((const __m256i *)w) : _mm256_setzero_si256();
        __m256 p[TILE][2];
        for (int b = 0; b < B; b++) p[b][0] = p[b][1] = _mm256_setzero_ps();
        for (int i = 0; i < 8; i++) {
            __m256i q = k23_q(t, v[i >> 2], hm, i);
            __m256i sc = _mm256_shuffle_epi8(s16, _mm256_set1_epi16((short)(0x0100 + 0x0202 * i)));
            for (int b = 0; b < B; b++) {
                const q8blk *xb = xq + b * ldq + 8 * k + i;
                __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(q, _mm256_loadu_si256((const __m256i *)xb->q)), sc);
                p[b][i & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(xb->d), p[b][i & 1]);
            }
        }
        for (int b = 0; b < B; b++) {
            const float *xsb = xs + b * ldxs + 16 * k;
            __m256 o = _mm256_fmadd_ps(o_hi, _mm256_loadu_ps(xsb + 8), _mm256_mul_ps(o_lo, _mm256_loadu_ps(xsb)));
            __m256 s = _mm256_add_ps(p[b][0], p[b][1]);
            if (t == T_Q2_K)
                acc[b] = _mm256_fnmadd_ps(o, _mm256_set1_ps(f16c_f32(rd16(w + 82))), _mm256_fmadd_ps(s, d, acc[b]));
            else
                acc[b] = _mm256_fmadd_ps(_mm256_fnmadd_ps(o, _mm256_set1_ps(4.f), s), d, acc[b]);
        }
    }
    for (int b = 0; b < B; b++) y[b * ldy] = hsum8(acc[b]);
}

AVX2 static INLINE float dot_fast_k23(int t, const uint8_t *w, const q8blk *xq, const float *xs, int nb) {
    float y;
    k23_fast_tile(t, w, xq, 0, xs, 0, nb, 1, &y, 0);
    return y;
}

AVX2 static INLINE void dots_fast_k23(int t, const uint8_t *w, const q8blk *xq, int64_t ldq, const float *xs, int nb, int B,
                               float *y, int64_t ldy) {
    int64_t ldxs = 16 * k23_ld(nb);
    for (int b = 0; b < B; b += TILE, xq += TILE * ldq, xs += TILE * ldxs, y += TILE * ldy)
        switch (B - b < TILE ? B - b : TILE) {  /* constant counts: each case its own inlined copy */
        case 4: k23_fast_tile(t, w, xq, ldq, xs, ldxs, nb, 4, y, ldy); break;
        case 3: k23_fast_tile(t, w, xq, ldq, xs, ldxs, nb, 3, y, ldy); break;
        case 2: k23_fast_tile(t, w, xq, ldq, xs, ldxs, nb, 2, y, ldy); break;
        default: k23_fast_tile(t, w, xq, ldq, xs, ldxs, nb, 1, y, ldy);
        }
}

/* A block's float scales and mins (as kunpack: d sc, dmin m; Q3_K's mins 0) */
AVX2 static INLINE void k23_scales_f(int t, const uint8_t *w, float scl[16], float mn[16]) {
    __m128i mn8, sc8 = k23_scales(t, w, &mn8);
    __m256 a, b;
    __m256 d = _mm256_set1_ps(f16c_f32(rd16(w + (t == T_Q2_K ? 80 : 108))));
    __m256 dmin = _mm256_set1_ps(t == T_Q2_K ? f16c_f32(rd16(w + 82)) : 0.f);
    i8x16_to_f(sc8, &a, &b);
    _mm256_storeu_ps(scl, _mm256_mul_ps(d, a)), _mm256_storeu_ps(scl + 8, _mm256_mul_ps(d, b));
    i8x16_to_f(mn8, &a, &b);
    _mm256_storeu_ps(mn, _mm256_mul_ps(dmin, a)), _mm256_storeu_ps(mn + 8, _mm256_mul_ps(dmin, b));
}

/* q8 block i's 32 values signed: Q2_K q, Q3_K q + 4 - 4 */
AVX2 static INLINE __m256i k23_qs(int t, __m256i v, __m256i hm, int i) {
    __m256i q = k23_q(t, v, hm, i);
    return t == T_Q3_K ? _mm256_sub_epi8(q, _mm256_set1_epi8(4)) : q;
}

/* Exact mode, B tokens against one row of n values (x: token b at x + b ldx): per sub-block
 * scale (q . x) and, Q2_K, min sum(x), as Q4_K's */
AVX2 static INLINE void k23_exact_tile(int t, const uint8_t *w, const float *x, int64_t ldx, int n, int B, float *y,
                                       int64_t ldy) {
    __m256 acc[TILE], accm[TILE], f[4];
    float scl[16], mn[16];
    for (int b = 0; b < B; b++) acc[b] = accm[b] = _mm256_setzero_ps();
    const int bytes = type_bytes(t), qs_at = t == T_Q2_K ? 16 : 32;
    for (int k = 0; k < n / QKK; k++, w += bytes) {
        k23_scales_f(t, w, scl, mn);
        __m256i v[2] = {_mm256_loadu_si256((const __m256i *)(w + qs_at)), _mm256_loadu_si256((const __m256i *)(w + qs_at + 32))};
        __m256i hm = t == T_Q3_K ? _mm256_loadu_si256((const __m256i *)w) : _mm256_setzero_si256();
        for (int i = 0; i < 8; i++) {
            i8x32_to_f(k23_qs(t, v[i >> 2], hm, i), f);
            __m256 s_lo = _mm256_set1_ps(scl[2 * i]), s_hi = _mm256_set1_ps(scl[2 * i + 1]);
            __m256 m_lo = _mm256_set1_ps(mn[2 * i]), m_hi = _mm256_set1_ps(mn[2 * i + 1]);
            for (int b = 0; b < B; b++) {
                const float *xb = x + b * ldx + k * QKK + i * QK;
                acc[b] = f32x32_dot2(f, xb, acc[b], s_lo, s_hi);
                if (t == T_Q2_K)
                    accm[b] = _mm256_fmadd_ps(_mm256_add_ps(_mm256_loadu_ps(xb + 16), _mm256_loadu_ps(xb + 24)), m_hi,
                                              _mm256_fmadd_ps(_mm256_add_ps(_mm256_loadu_ps(xb), _mm256_loadu_ps(xb + 8)), m_lo, accm[b]));
            }
        }
    }
    for (int b = 0; b < B; b++) y[b * ldy] = hsum8(_mm256_sub_ps(acc[b], accm[b]));
}

/* y (n floats) += a * one row: per sub-block (a scale) q - a min */
AVX2 static void axpy_k23(int t, const uint8_t *w, float a, float *y, int n) {
    float scl[16], mn[16];
    const int bytes = type_bytes(t), qs_at = t == T_Q2_K ? 16 : 32;
    for (int k = 0; k < n / QKK; k++, w += bytes) {
        k23_scales_f(t, w, scl, mn);
        __m256i v[2] = {_mm256_loadu_si256((const __m256i *)(w + qs_at)), _mm256_loadu_si256((const __m256i *)(w + qs_at + 32))};
        __m256i hm = t == T_Q3_K ? _mm256_loadu_si256((const __m256i *)w) : _mm256_setzero_si256();
        for (int i = 0; i < 8; i++, y += QK) {
            __m256i q = k23_qs(t, v[i >> 2], hm, i);
            __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
            __m256i qi[4] = {_mm256_cvtepi8_epi32(lo), _mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)),
                             _mm256_cvtepi8_epi32(hi), _mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))};
            for (int u = 0; u < 4; u++) {
                int j = 2 * i + u / 2;
                __m256 v8 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(qi[u]), _mm256_set1_ps(a * scl[j]), _mm256_set1_ps(-a * mn[j]));
                _mm256_storeu_ps(y + 8 * u, _mm256_add_ps(v8, _mm256_loadu_ps(y + 8 * u)));
            }
        }
    }
}

AVX2 static float dot_exact_k23(int t, const uint8_t *w, const float *x, int n) {
    float y;
    k23_exact_tile(t, w, x, 0, n, 1, &y, 0);
    return y;
}
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
    case T_Q5_0: case T_Q5_1: case T_IQ4_NL: case T_MXFP4: {  /* as Q4_0 (Q5_0: q - 16), Q4_1 (Q5_1: the min) */
        const __m256i off = _mm256_set1_epi8(t == T_Q5_0 ? 16 : 0);
        int bytes = type_bytes(t);
        for (int k = 0; k < nb; k++, w += bytes) {
            i8x32_to_f(_mm256_sub_epi8(q32_values(t, w), off), f);
            __m256 sc = _mm256_set1_ps(q32_d(t, w));
            for (int b = 0; b < B; b++) acc[b] = f32x32_dot(f, x + b * ldx + k * QK, acc[b], sc);
            if (t == T_Q5_1) {
                __m256 mn = _mm256_set1_ps(f16c_f32(rd16(w + 2)));
                for (int b = 0; b < B; b++) accm[b] = _mm256_fmadd_ps(sum32(x + b * ldx + k * QK), mn, accm[b]);
            }
        }
        for (int b = 0; b < B; b++) y[b * ldy] = hsum8(_mm256_add_ps(acc[b], accm[b]));
        return;
    }
    case T_IQ4_XS: {
        float scl[8];
        for (int k = 0; k < n / QKK; k++, w += 136) {
            _mm256_storeu_ps(scl, iq4xs_scales(w));
            for (int j = 0; j < 8; j++) {
                i8x32_to_f(iq4_values(w + 8 + 16 * j), f);
                __m256 sc = _mm256_set1_ps(scl[j]);
                for (int b = 0; b < B; b++) acc[b] = f32x32_dot(f, x + b * ldx + k * QKK + j * QK, acc[b], sc);
            }
        }
        for (int b = 0; b < B; b++) y[b * ldy] = hsum8(acc[b]);
        return;
    }
    case T_IQ3_XXS: case T_IQ3_S: {
        float scl[8];
        for (int k = 0; k < n / QKK; k++, w += type_bytes(t)) {
            _mm256_storeu_ps(scl, iq3_scales(t, w));
            for (int j = 0; j < 8; j++) {
                i8x32_to_f(_mm256_sign_epi8(iq3_grid8(t, w, j), iq3_signs8(t, w, j)), f);
                __m256 sc = _mm256_set1_ps(scl[j]);
                for (int b = 0; b < B; b++) acc[b] = f32x32_dot(f, x + b * ldx + k * QKK + j * QK, acc[b], sc);
            }
        }
        for (int b = 0; b < B; b++) y[b * ldy] = hsum8(acc[b]);
        return;
    }
    case T_Q2_K: case T_Q3_K:
        k23_exact_tile(t, w, x, ldx, n, B, y, ldy);
        return;
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
    case T_Q5_0:  /* q unsigned times x, less 16 sum(x) in one int32 lane: exact, no float work */
        for (int k = 0; k < nb; k++, w += 22) {
            __m256i u = q32_values(t, w);
            float d = f16c_f32(rd16(w));
            for (int b = 0; b < B; b++) {
                const q8blk *xb = xq + b * ldq + k;
                __m256i s = _mm256_sub_epi32(dot_u8s8(u, _mm256_loadu_si256((const __m256i *)xb->q)), _mm256_zextsi128_si256(_mm_cvtsi32_si128(16 * xb->s)));
                acc[b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(d * xb->d), acc[b]);
            }
        }
        for (int b = 0; b < B; b++) y[b * ldy] = hsum8(acc[b]);
        return;
    case T_Q5_1:  /* as Q4_1: the min times sum(x) in scalar, in one fused multiply-add */
        for (int k = 0; k < nb; k++, w += 24) {
            __m256i u = q32_values(t, w);
            float d = f16c_f32(rd16(w)), m = f16c_f32(rd16(w + 2));
            for (int b = 0; b < B; b++) {
                const q8blk *xb = xq + b * ldq + k;
                __m256i s = dot_u8s8(u, _mm256_loadu_si256((const __m256i *)xb->q));
                acc[b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(d * xb->d), acc[b]);
                extra[b] = fmaf(m * xb->d, (float)xb->s, extra[b]);
            }
        }
        for (int b = 0; b < B; b++) y[b * ldy] = hsum8(acc[b]) + extra[b];
        return;
    case T_IQ4_NL: case T_MXFP4:  /* signed values: Q8_0's |w| times x with w's sign */
        for (int k = 0; k < nb; k++, w += type_bytes(t)) {
            __m256i q = q32_values(t, w), qa = _mm256_sign_epi8(q, q);
            float d = q32_d(t, w);
            for (int b = 0; b < B; b++) {
                const q8blk *xb = xq + b * ldq + k;
                __m256i s = dot_u8s8(qa, _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)xb->q), q));
                acc[b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(d * xb->d), acc[b]);
            }
        }
        for (int b = 0; b < B; b++) y[b * ldy] = hsum8(acc[b]);
        return;
    case T_IQ4_XS: {  /* sub-block j of 32 is q8 block j of the 8 a block spans; even and odd apart */
        float scl[8];
        for (int k = 0; k < nb / 8; k++, w += 136) {
            _mm256_storeu_ps(scl, iq4xs_scales(w));
            for (int j = 0; j < 8; j += 2) {
                __m256i q0, q1;
                iq4_values2(w + 8 + 16 * j, &q0, &q1);
                __m256i a0 = _mm256_sign_epi8(q0, q0), a1 = _mm256_sign_epi8(q1, q1);
                for (int b = 0; b < B; b++) {
                    const q8blk *xb = xq + b * ldq + 8 * k + j;
                    __m256i s0 = dot_u8s8(a0, _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)xb[0].q), q0));
                    __m256i s1 = dot_u8s8(a1, _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)xb[1].q), q1));
                    acc[b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), _mm256_set1_ps(scl[j] * xb[0].d), acc[b]);
                    acc2[b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), _mm256_set1_ps(scl[j + 1] * xb[1].d), acc2[b]);
                }
            }
        }
        for (int b = 0; b < B; b++) y[b * ldy] = hsum8(_mm256_add_ps(acc[b], acc2[b]));
        return;
    }
    case T_IQ3_XXS: case T_IQ3_S: {  /* as IQ4_XS: the grid values unsigned, each token's x signed by them */
        float scl[8];
        for (int k = 0; k < nb / 8; k++, w += type_bytes(t)) {
            _mm256_storeu_ps(scl, iq3_scales(t, w));
            for (int j = 0; j < 8; j += 2) {
                __m256i g0 = iq3_grid8(t, w, j), s0 = iq3_signs8(t, w, j);
                __m256i g1 = iq3_grid8(t, w, j + 1), s1 = iq3_signs8(t, w, j + 1);
                for (int b = 0; b < B; b++) {
                    const q8blk *xb = xq + b * ldq + 8 * k + j;
                    __m256i p0 = dot_u8s8(g0, _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)xb[0].q), s0));
                    __m256i p1 = dot_u8s8(g1, _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)xb[1].q), s1));
                    acc[b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(scl[j] * xb[0].d), acc[b]);
                    acc2[b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_set1_ps(scl[j + 1] * xb[1].d), acc2[b]);
                }
            }
        }
        for (int b = 0; b < B; b++) y[b * ldy] = hsum8(_mm256_add_ps(acc[b], acc2[b]));
        return;
    }
    default:
        for (int b = 0; b < B; b++) y[b * ldy] = dot_fast_c(t, w, xq + b * ldq, nb);
    }
}

AVX2 static INLINE void dots_exact_avx2(int t, const uint8_t *w, const float *x, int64_t ldx, int n, int B, float *y, int64_t ldy) {
    if (t == T_F16 || t == T_BF16) {  /* token by token, the row in L1 after the first (dot_half_avx2) */
        for (int b = 0; b < B; b++) y[b * ldy] = dot_half_avx2(t, w, x + b * ldx, n);
        return;
    }
    for (int b = 0; b < B; b += TILE, x += TILE * ldx, y += TILE * ldy)
        switch (B - b < TILE ? B - b : TILE) {  /* constant counts: each case its own inlined copy */
        case 4: dots_exact_tile(t, w, x, ldx, n, 4, y, ldy); break;
        case 3: dots_exact_tile(t, w, x, ldx, n, 3, y, ldy); break;
        case 2: dots_exact_tile(t, w, x, ldx, n, 2, y, ldy); break;
        default: dots_exact_tile(t, w, x, ldx, n, 1, y, ldy);
        }
}

AVX2 static INLINE void dots_fast_avx2(int t, const uint8_t *w, const q8blk *xq, int64_t ldq, int nb, int B, float *y, int64_t ldy) {
    for (int b = 0; b < B; b += TILE, xq += TILE * ldq, y += TILE * ldy)
        switch (B - b < TILE ? B - b : TILE) {
        case 4: dots_fast_tile(t, w, xq, ldq, nb, 4, y, ldy); break;
        case 3: dots_fast_tile(t, w, xq, ldq, nb, 3, y, ldy); break;
        case 2: dots_fast_tile(t, w, xq, ldq, nb, 2, y, ldy); break;
        default: dots_fast_tile(t, w, xq, ldq, nb, 1, y, ldy);
        }
}

/* ---- the activations' quantization, AVX2 ------------------------------------------------------ */

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
