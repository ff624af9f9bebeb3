/* simd_avx2.c (and simd_avx512.c, for its helpers), part:
 * one copy of LEVEL_SOURCE (an AVX2 source written over the macros below) at
 * each 256-bit level: AVX2 (maddubs summed in int16, madd), AVX-VNNI (VEX vpdpbusd: Intel
 * 12th-14th gen, Core Ultra) and the same vpdpbusd EVEX-encoded on 256-bit registers, which only
 * CPUs with AVX-512 VNNI run: there the tests exercise the AVX-VNNI level's code
 * (set_isa("avxvnni")), whose VEX copy no machine here can run. Names end in _avx2, _avxvnni and
 * _vnni256. Included by interleaved_256.c and cols_256.c, each naming its source. */
#if HAVE_X86
#define DP256 0
#define LV AVX2
#define NM(f) f##_avx2
#define ACC16(s, u, x) _mm256_add_epi16((s), _mm256_maddubs_epi16((u), (x)))
#define FIN16(s) _mm256_madd_epi16((s), _mm256_set1_epi16(1))
#include LEVEL_SOURCE
#undef DP256
#undef LV
#undef NM
#undef ACC16
#undef FIN16

#define DP256 1
#define ACC16(s, u, x) DPB((s), (u), (x))
#define FIN16(s) (s)
#define LV AVXVNNI
#define NM(f) f##_avxvnni
#define DPB(s, u, x) _mm256_dpbusd_avx_epi32(s, u, x)
#include LEVEL_SOURCE
#undef LV
#undef NM
#undef DPB

#define LV VNNI256
#define NM(f) f##_vnni256
#define DPB(s, u, x) _mm256_dpbusd_epi32(s, u, x)
#include LEVEL_SOURCE
#undef LV
#undef NM
#undef DPB
#undef DP256
#undef ACC16
#undef FIN16
#endif
#undef LEVEL_SOURCE
