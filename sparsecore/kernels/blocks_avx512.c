/* simd_avx512.c, part: fast mode's products on the file's blocks with AVX-512 VNNI, the activations
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

/* the types with VNNI steps here; Q5_0, Q5_1, IQ4_NL and IQ4_XS take AVX2's kernels (pack_x), and
 * IQ3_XXS and IQ3_S where the CPU lacks AVX512_VBMI (use_vbmi: their steps need vpermi2b) */
static inline int vnni_type(int t) {
    return t == T_Q4_0 || t == T_Q4_1 || t == T_Q8_0 || t == T_Q4_K || t == T_Q5_K || t == T_Q6_K || (is_iq3(t) && use_vbmi);
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

/* ---- IQ3_XXS and IQ3_S with AVX512_VBMI -------------------------------------------------------
 * AVX2 looks a block's 64 grid words up one at a time (a gather of 8 per sub-block: one token's
 * rows ran at a third of Q5_0's speed, bound by the lookups). Here the 64 indices of a block look
 * up all at once: per grid word two bytes of 3-bit codes (two values a byte, a nibble each), each
 * byte a table of 256 (IQ3_XXS) or 512 (IQ3_S) entries read by vpermi2b 128 at a time, the index's
 * bit 7 (and IQ3_S's bit 8, qh as a 64-bit mask) choosing among them; per 64 values, vpermi2b puts
 * each grid word's two code bytes side by side and vpmultishiftqb takes the nibbles out in order
 * (IQ3_S's nibbles are its values, IQ3_XXS's codes become values by pshufb with its 8 grid
 * values). 4 unpacks and 8 128-bit shuffles after the nibbles instead took 1.1x (IQ3_XXS) and 1.2x
 * (IQ3_S) the time. Signs: a 64-bit mask per sub-block pair (IQ3_S's bits as they are; IQ3_XXS's
 * 7-bit indices by vpmultishiftqb, then ksigns_iq3 by vpermi2b), x negated under it (x is at most
 * 127 in magnitude), vpdpbusd with the unsigned values. Per (pair, token) as the other types'
 * steps: one vpdpbusd, a convert, one FMA, the scales of a block's 8 sub-blocks times x's in one
 * multiply per token (per pair: 1.19x the time); one token is the tile of one token, so its floats
 * do not depend on its batch. */
static _Alignas(64) const uint8_t iq3xxs_nib[2][256] = {{
    0, 2, 4, 17, 19, 23, 32, 34, 49, 66, 115, 117, 1, 3, 16, 18, 33, 37, 48, 50, 65, 84, 112, 0, 2, 4, 17, 32, 34, 49, 51, 55,
    81, 87, 117, 1, 7, 16, 18, 37, 112, 19, 55, 68, 87, 115, 117, 1, 7, 50, 82, 53, 100, 16, 20, 22, 67, 97, 1, 3, 16, 18, 33, 35,
    48, 50, 52, 71, 80, 0, 2, 17, 32, 34, 1, 3, 16, 18, 33, 48, 114, 0, 2, 32, 49, 70, 102, 1, 5, 80, 32, 36, 70, 113, 5, 34,
    64, 0, 2, 17, 19, 32, 34, 38, 49, 66, 1, 3, 5, 16, 18, 33, 48, 99, 103, 112, 0, 2, 17, 23, 32, 34, 55, 64, 85, 1, 16, 20,
    112, 116, 53, 83, 3, 39, 65, 116, 1, 3, 22, 69, 1, 16, 18, 33, 35, 80, 101, 114, 0, 2, 32, 49, 68, 70, 1, 3, 16, 37, 82, 114,
    17, 51, 48, 71, 114, 0, 6, 34, 85, 20, 54, 99, 51, 96, 4, 23, 53, 55, 83, 87, 116, 32, 55, 64, 96, 102, 7, 69, 4, 81, 100, 37,
    67, 112, 5, 16, 18, 48, 18, 65, 112, 0, 6, 38, 85, 20, 50, 114, 2, 83, 16, 35, 39, 114, 2, 49, 80, 36, 66, 36, 68, 70, 100, 33,
    97, 23, 100, 48, 54, 68, 5, 82, 51, 3, 33, 3, 5, 7, 16, 50, 82, 38, 64, 18, 69, 82, 0, 21, 51, 96, 33, 65, 0, 2, 36, 48,
}, {
    0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 2,
    2, 2, 2, 3, 3, 3, 3, 3, 3, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 7, 7, 7, 7, 7, 16, 16, 16, 16, 16, 16,
    16, 16, 16, 16, 16, 17, 17, 17, 17, 17, 18, 18, 18, 18, 18, 18, 18, 19, 19, 19, 19, 19, 19, 20, 20, 20, 21, 21, 21, 21, 22, 23,
    23, 32, 32, 32, 32, 32, 32, 32, 32, 32, 33, 33, 33, 33, 33, 33, 33, 33, 33, 33, 34, 34, 34, 34, 34, 34, 34, 34, 34, 35, 35, 35,
    35, 35, 36, 36, 37, 37, 37, 37, 39, 39, 39, 39, 48, 48, 48, 48, 48, 48, 48, 48, 49, 49, 49, 49, 49, 49, 50, 50, 50, 50, 50, 50,
    51, 51, 52, 52, 52, 53, 53, 53, 53, 54, 54, 54, 55, 55, 64, 64, 64, 64, 64, 64, 65, 66, 66, 66, 66, 66, 67, 67, 68, 68, 68, 69,
    69, 69, 71, 71, 71, 71, 80, 80, 80, 81, 81, 81, 81, 82, 82, 82, 83, 83, 84, 84, 84, 84, 85, 85, 86, 87, 87, 96, 96, 96, 96, 97,
    97, 98, 98, 99, 99, 100, 101, 101, 102, 103, 103, 112, 112, 112, 112, 112, 112, 113, 113, 114, 114, 114, 115, 115, 115, 115, 116, 116, 117, 117, 117, 118,
}};
static _Alignas(64) const uint8_t iq3s_nib[2][512] = {{
    17, 19, 21, 27, 31, 49, 51, 53, 57, 61, 81, 83, 91, 119, 145, 149, 155, 159, 179, 183, 209, 213, 243, 249, 255, 17, 19, 21, 25, 49, 51, 59,
    81, 87, 95, 115, 123, 153, 211, 219, 245, 17, 19, 27, 31, 49, 55, 61, 83, 91, 113, 121, 149, 155, 159, 179, 183, 241, 247, 23, 51, 59, 81, 85,
    115, 119, 125, 153, 177, 181, 223, 243, 251, 17, 55, 63, 83, 89, 117, 145, 151, 179, 241, 21, 25, 81, 85, 93, 119, 147, 155, 159, 221, 247, 29, 51,
    55, 115, 181, 243, 17, 21, 25, 81, 85, 93, 119, 177, 185, 17, 19, 21, 25, 49, 51, 55, 59, 63, 81, 85, 115, 121, 125, 185, 189, 211, 245, 17,
    19, 23, 29, 49, 57, 83, 113, 119, 147, 177, 181, 241, 253, 17, 53, 59, 63, 81, 89, 117, 145, 151, 187, 209, 245, 19, 25, 31, 49, 55, 83, 95,
    113, 121, 147, 213, 241, 23, 27, 53, 57, 115, 119, 149, 157, 177, 185, 19, 49, 55, 83, 113, 117, 179, 81, 89, 95, 153, 157, 19, 23, 49, 53, 83,
    123, 147, 213, 241, 17, 19, 23, 27, 31, 49, 53, 57, 61, 83, 87, 95, 113, 117, 147, 151, 155, 177, 181, 223, 241, 247, 251, 17, 21, 49, 55, 63,
    85, 91, 115, 121, 149, 179, 19, 25, 31, 83, 87, 113, 127, 147, 183, 191, 243, 249, 17, 21, 27, 51, 85, 89, 115, 119, 149, 177, 221, 19, 31, 81,
    87, 117, 123, 147, 245, 251, 25, 51, 85, 127, 145, 183, 241, 17, 21, 31, 83, 187, 211, 27, 51, 93, 113, 151, 177, 21, 51, 55, 59, 63, 85, 115,
    119, 123, 149, 153, 159, 179, 215, 243, 19, 23, 27, 57, 83, 87, 145, 209, 245, 253, 17, 53, 81, 117, 121, 177, 19, 49, 57, 83, 87, 95, 113, 147,
    151, 159, 187, 247, 23, 51, 61, 85, 115, 181, 209, 217, 19, 49, 53, 91, 117, 153, 189, 247, 61, 147, 19, 23, 81, 85, 123, 17, 25, 53, 81, 89,
    95, 117, 147, 177, 241, 21, 31, 51, 55, 85, 113, 123, 151, 179, 187, 19, 23, 49, 59, 83, 119, 145, 191, 213, 241, 25, 51, 55, 81, 85, 115, 123,
    17, 21, 89, 127, 145, 243, 27, 31, 83, 213, 55, 121, 209, 49, 59, 113, 151, 179, 21, 49, 57, 85, 145, 153, 159, 181, 221, 249, 19, 23, 27, 53,
    83, 117, 245, 17, 51, 87, 113, 125, 183, 21, 31, 49, 95, 153, 179, 219, 247, 19, 25, 81, 117, 157, 53, 93, 179, 183, 149, 21, 25, 85, 51, 55,
    59, 115, 119, 209, 17, 81, 95, 217, 53, 121, 149, 187, 213, 241, 17, 57, 83, 145, 91, 151, 213, 17, 23, 121, 209, 27, 145, 51, 55, 17, 25, 31,
    81, 85, 125, 145, 185, 213, 21, 51, 89, 151, 155, 19, 25, 49, 61, 83, 113, 179, 21, 117, 123, 183, 19, 27, 55, 81, 177, 85, 149, 21, 115, 17,
}, {
    17, 17, 17, 17, 17, 17, 17, 17, 17, 17, 17, 17, 17, 17, 17, 17, 17, 17, 17, 17, 17, 17, 17, 17, 17, 19, 19, 19, 19, 19, 19, 19,
    19, 19, 19, 19, 19, 19, 19, 19, 19, 21, 21, 21, 21, 21, 21, 21, 21, 21, 21, 21, 21, 21, 21, 21, 21, 21, 21, 23, 23, 23, 23, 23,
    23, 23, 23, 23, 23, 23, 23, 23, 23, 25, 25, 25, 25, 25, 25, 25, 25, 25, 25, 27, 27, 27, 27, 27, 27, 27, 27, 27, 27, 27, 29, 29,
    29, 29, 29, 29, 31, 31, 31, 31, 31, 31, 31, 31, 31, 49, 49, 49, 49, 49, 49, 49, 49, 49, 49, 49, 49, 49, 49, 49, 49, 49, 49, 51,
    51, 51, 51, 51, 51, 51, 51, 51, 51, 51, 51, 51, 51, 53, 53, 53, 53, 53, 53, 53, 53, 53, 53, 53, 53, 55, 55, 55, 55, 55, 55, 55,
    55, 55, 55, 55, 55, 57, 57, 57, 57, 57, 57, 57, 57, 57, 57, 59, 59, 59, 59, 59, 59, 59, 61, 61, 61, 61, 61, 63, 63, 63, 63, 63,
    63, 63, 63, 63, 81, 81, 81, 81, 81, 81, 81, 81, 81, 81, 81, 81, 81, 81, 81, 81, 81, 81, 81, 81, 81, 81, 81, 83, 83, 83, 83, 83,
    83, 83, 83, 83, 83, 83, 85, 85, 85, 85, 85, 85, 85, 85, 85, 85, 85, 85, 87, 87, 87, 87, 87, 87, 87, 87, 87, 87, 87, 89, 89, 89,
    89, 89, 89, 89, 89, 89, 91, 91, 91, 91, 91, 91, 91, 93, 93, 93, 93, 93, 93, 95, 95, 95, 95, 95, 95, 113, 113, 113, 113, 113, 113, 113,
    113, 113, 113, 113, 113, 113, 113, 113, 115, 115, 115, 115, 115, 115, 115, 115, 115, 115, 117, 117, 117, 117, 117, 117, 119, 119, 119, 119, 119, 119, 119, 119,
    119, 119, 119, 119, 121, 121, 121, 121, 121, 121, 121, 121, 123, 123, 123, 123, 123, 123, 123, 123, 125, 125, 127, 127, 127, 127, 127, 145, 145, 145, 145, 145,
    145, 145, 145, 145, 145, 147, 147, 147, 147, 147, 147, 147, 147, 147, 147, 149, 149, 149, 149, 149, 149, 149, 149, 149, 149, 151, 151, 151, 151, 151, 151, 151,
    153, 153, 153, 153, 153, 153, 155, 155, 155, 155, 157, 157, 157, 159, 159, 159, 159, 159, 177, 177, 177, 177, 177, 177, 177, 177, 177, 177, 179, 179, 179, 179,
    179, 179, 179, 181, 181, 181, 181, 181, 181, 183, 183, 183, 183, 183, 183, 183, 183, 185, 185, 185, 185, 185, 187, 187, 187, 187, 189, 191, 191, 191, 209, 209,
    209, 209, 209, 209, 211, 211, 211, 211, 213, 213, 213, 213, 213, 213, 215, 215, 215, 215, 217, 217, 217, 219, 219, 219, 219, 221, 221, 223, 223, 241, 241, 241,
    241, 241, 241, 241, 241, 241, 243, 243, 243, 243, 243, 245, 245, 245, 245, 245, 245, 245, 247, 247, 247, 247, 249, 249, 249, 249, 249, 251, 251, 253, 253, 255,
}};
static _Alignas(64) const uint8_t iq3_expand[64] = {0, 64, 1, 65, 0, 0, 0, 0, 2, 66, 3, 67, 0, 0, 0, 0, 4, 68, 5, 69, 0, 0, 0, 0, 6, 70, 7, 71, 0, 0, 0, 0, 8, 72, 9, 73, 0, 0, 0, 0, 10, 74, 11, 75, 0, 0, 0, 0, 12, 76, 13, 77, 0, 0, 0, 0, 14, 78, 15, 79, 0, 0, 0, 0};
/* 64 indices idx (bit 7 set: mask m7; IQ3_S's bit 8: m8) through the 2 code bytes of table nib
 * (n entries): each code byte of the 64 grid words */
VBMI static INLINE __m512i iq3_codes(const uint8_t *tab, int n, __m512i idx, __mmask64 m7, __mmask64 m8) {
    const __m512i *T = (const __m512i *)tab;
    __m512i a = _mm512_mask_blend_epi8(m7, _mm512_permutex2var_epi8(T[0], idx, T[1]), _mm512_permutex2var_epi8(T[2], idx, T[3]));
    if (n == 256) return a;
    __m512i b = _mm512_mask_blend_epi8(m7, _mm512_permutex2var_epi8(T[4], idx, T[5]), _mm512_permutex2var_epi8(T[6], idx, T[7]));
    return _mm512_mask_blend_epi8(m8, a, b);
}
/* a block's 256 grid values, unsigned, in order: g[k] = sub-blocks 2k, 2k+1; sgn[k]: their signs */
VBMI static INLINE void iq3_unpack_vbmi(int t, const uint8_t *w, __m512i g[4], __mmask64 sgn[4]) {
    int s = t == T_IQ3_S, n = s ? 512 : 256;
    const uint8_t *tab = s ? &iq3s_nib[0][0] : &iq3xxs_nib[0][0];
    __m512i idx = _mm512_loadu_si512(w + 2);
    __mmask64 m7 = _mm512_movepi8_mask(idx), m8 = s ? _cvtu64_mask64((uint64_t)(uint32_t)rd32(w + 66) | (uint64_t)(uint32_t)rd32(w + 70) << 32) : 0;
    __m512i c01 = iq3_codes(tab, n, idx, m7, m8), c23 = iq3_codes(tab + n, n, idx, m7, m8);
    /* g[k]: per qword two grid words' code bytes (vpermi2b), their 8 nibbles (vpmultishiftqb) */
    const __m512i m4 = _mm512_set1_epi8(15), ex = _mm512_load_si512(iq3_expand);
    const __m512i sh = _mm512_set1_epi64(0x1c1814100c080400LL);
    const __m512i map = _mm512_broadcast_i32x4(_mm_setr_epi8(4, 12, 20, 28, 36, 44, 52, 62, 0, 0, 0, 0, 0, 0, 0, 0));
    for (int k = 0; k < 4; k++) {
        __m512i c = _mm512_permutex2var_epi8(c01, _mm512_add_epi8(ex, _mm512_set1_epi8((char)(16 * k))), c23);
        c = _mm512_and_si512(_mm512_multishift_epi64_epi8(sh, c), m4);
        g[k] = s ? c : _mm512_shuffle_epi8(map, c);  /* IQ3_S's nibbles are its values, IQ3_XXS's codes */
    }
    if (s) {
        for (int k = 0; k < 4; k++) sgn[k] = _cvtu64_mask64((uint64_t)(uint32_t)rd32(w + 74 + 8 * k) | (uint64_t)(uint32_t)rd32(w + 78 + 8 * k) << 32);
        return;
    }
    /* byte 4 j + i of the 32: bits 7 i ..+8 of sub-block j's word, & 127, through ksigns_iq3 */
    __m256i a = _mm256_loadu_si256((const __m256i *)(w + 66));
    __m256i ix = _mm256_and_si256(_mm256_multishift_epi64_epi8(_mm256_set1_epi64x(0x352e2720150e0700LL), a), _mm256_set1_epi8(127));
    __m512i ks = _mm512_loadu_si512(ksigns_iq3);
    __m256i sb = _mm512_castsi512_si256(_mm512_permutex2var_epi8(ks, _mm512_castsi256_si512(ix), _mm512_loadu_si512(ksigns_iq3 + 64)));
    sgn[0] = _cvtu64_mask64((uint64_t)_mm256_extract_epi64(sb, 0)), sgn[1] = _cvtu64_mask64((uint64_t)_mm256_extract_epi64(sb, 1));
    sgn[2] = _cvtu64_mask64((uint64_t)_mm256_extract_epi64(sb, 2)), sgn[3] = _cvtu64_mask64((uint64_t)_mm256_extract_epi64(sb, 3));
}

VBMI static INLINE void iq3_vbmi_tile(int t, const uint8_t *w, const xpair *xp, int nb, int B, float *y, int64_t ldy) {
    __m512 acc[TILE_V];
    int64_t ld = xp_ld(nb), np = (nb + 1) / 2;
    for (int b = 0; b < B; b++) acc[b] = _mm512_setzero_ps();
    for (int k = 0; k < nb / 8; k++, w += type_bytes(t)) {
        __m512i g[4];
        __mmask64 sg[4];
        __m256 scl = iq3_scales(t, w);
        iq3_unpack_vbmi(t, w, g, sg);
        for (int b = 0; b < B; b++) {  /* per sub-block its scale times x's */
            __m256 p = _mm256_mul_ps(scl, _mm256_loadu_ps((const float *)(xp + b * ld + np) + 8 * k));
            for (int j = 0; j < 4; j++) {
                __m512i xv = XV2(xp + b * ld + 4 * k + j);
                __m512i s = dpbusd2(g[j], _mm512_mask_sub_epi8(xv, sg[j], _mm512_setzero_si512(), xv));
                acc[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), spread2(p, 2 * j), acc[b]);
            }
        }
    }
    for (int b = 0; b < B; b++) y[b * ldy] = hsum8(_mm256_add_ps(_mm512_castps512_ps256(acc[b]), _mm512_extractf32x8_ps(acc[b], 1)));
}

VBMI static void dots_iq3_vbmi(int t, const uint8_t *w, const xpair *xp, int nb, int B, float *y, int64_t ldy) {
    for (int b = 0; b < B; b += TILE_V, xp += TILE_V * xp_ld(nb), y += TILE_V * ldy)
        switch (B - b < TILE_V ? B - b : TILE_V) {
        case 8: iq3_vbmi_tile(t, w, xp, nb, 8, y, ldy); break;
        case 7: iq3_vbmi_tile(t, w, xp, nb, 7, y, ldy); break;
        case 6: iq3_vbmi_tile(t, w, xp, nb, 6, y, ldy); break;
        case 5: iq3_vbmi_tile(t, w, xp, nb, 5, y, ldy); break;
        case 4: iq3_vbmi_tile(t, w, xp, nb, 4, y, ldy); break;
        case 3: iq3_vbmi_tile(t, w, xp, nb, 3, y, ldy); break;
        case 2: iq3_vbmi_tile(t, w, xp, nb, 2, y, ldy); break;
        default: iq3_vbmi_tile(t, w, xp, nb, 1, y, ldy);
        }
}

VNNI static INLINE float dot_fast_vnni(int t, const uint8_t *w, const xpair *xp, int nb) {
    float y;
    if (is_iq3(t)) { dots_iq3_vbmi(t, w, xp, nb, 1, &y, 0); return y; }
    dots_fast_vnni_tile(t, w, xp, nb, 1, 1, &y, 0);
    return y;
}

/* alone: xp is one token's pack (vnni_pack with B = 1), not a tile of a batch's */
VNNI static INLINE void dots_fast_vnni(int t, const uint8_t *w, const xpair *xp, int nb, int B, int alone, float *y,
                                int64_t ldy) {
    if (is_iq3(t)) { dots_iq3_vbmi(t, w, xp, nb, B, y, ldy); return; }
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
