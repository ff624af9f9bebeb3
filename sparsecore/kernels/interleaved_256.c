/* _kernels.c, part: interleaved_avx2.c's kernels at each 256-bit level, one copy each, the same
 * source: AVX2 (maddubs / madd), AVX-VNNI (VEX vpdpbusd: Intel 12th-14th gen, Core Ultra) and the
 * same vpdpbusd EVEX-encoded on 256-bit registers, which only CPUs with AVX-512 VNNI run: there
 * the tests exercise the AVX-VNNI level's code (set_isa("avxvnni")), whose VEX copy no machine
 * here can run. Names end in _avx2, _avxvnni and _vnni256. */
#if HAVE_X86
#define TILE_A 4 /* tokens per tile: 2 halves x 4 accumulators and a half's 8 value registers */

#define DP256 0
#define LV AVX2
#define NM(f) f##_avx2
#define ACC16(s, u, x) _mm256_add_epi16((s), _mm256_maddubs_epi16((u), (x)))
#define FIN16(s) _mm256_madd_epi16((s), _mm256_set1_epi16(1))
#include "interleaved_avx2.c"
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
#include "interleaved_avx2.c"
#undef LV
#undef NM
#undef DPB

#define LV VNNI256
#define NM(f) f##_vnni256
#define DPB(s, u, x) _mm256_dpbusd_epi32(s, u, x)
#include "interleaved_avx2.c"
#undef LV
#undef NM
#undef DPB
#undef DP256
#undef ACC16
#undef FIN16
#endif
