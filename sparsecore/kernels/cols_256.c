/* _kernels.c, part: cols_avx2.c's twin products at each 256-bit level, one copy each (as
 * interleaved_256.c does for the interleaved layouts): AVX2 (maddubs summed in int16, madd),
 * AVX-VNNI (VEX vpdpbusd) and its EVEX form, which the tests run on AVX-512 VNNI CPUs. Names
 * end in _avx2, _avxvnni and _vnni256. */
#if HAVE_X86
#define DP256 0
#define LV AVX2
#define NM(f) f##_avx2
#define ACC16(s, u, x) _mm256_add_epi16((s), _mm256_maddubs_epi16((u), (x)))
#define FIN16(s) _mm256_madd_epi16((s), _mm256_set1_epi16(1))
#include "cols_avx2.c"
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
#include "cols_avx2.c"
#undef LV
#undef NM
#undef DPB

#define LV VNNI256
#define NM(f) f##_vnni256
#define DPB(s, u, x) _mm256_dpbusd_epi32(s, u, x)
#include "cols_avx2.c"
#undef LV
#undef NM
#undef DPB
#undef DP256
#undef ACC16
#undef FIN16
#endif
