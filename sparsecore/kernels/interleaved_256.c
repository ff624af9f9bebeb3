/* simd_avx2.c (and simd_avx512.c, for its helpers), part:
 * interleaved_avx2.c's kernels at each 256-bit level (levels_256.c). */
#define TILE_A 4 /* tokens per tile: 2 halves x 4 accumulators and a half's 8 value registers */

#define LEVEL_SOURCE "interleaved_avx2.c"
#include "levels_256.c"
