/* _kernels.c, part: fast mode's products on the file's blocks with AVX-512 VNNI, the activations
 * repacked for them (vnni_pack), and Q4_0's axpy. */

#if HAVE_X86
/* ---- fast mode with AVX-512 VNNI (vpdpbusd, EVEX) ---------------------------------------------
 * Another float order than the AVX2 kernels (blocks_avx2.c; tested against them within tolerance only),
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
#define TILE_V 8

/* the types with VNNI steps here; Q5_0, Q5_1, IQ4_NL, IQ4_XS, IQ3_XXS and IQ3_S take AVX2's kernels (pack_x) */
static inline int vnni_type(int t) {
    return t == T_Q4_0 || t == T_Q4_1 || t == T_Q8_0 || t == T_Q4_K || t == T_Q5_K || t == T_Q6_K;
}

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
#endif
