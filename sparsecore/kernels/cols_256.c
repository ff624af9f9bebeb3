/* simd_avx2.c (and simd_avx512.c, for its helpers), part:
 * cols_avx2.c's twin products at each 256-bit level (levels_256.c). */
#define LEVEL_SOURCE "cols_avx2.c"
#include "levels_256.c"
