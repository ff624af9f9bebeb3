/* _kernels.c, simd_avx2.c and simd_avx512.c, part: what every other part builds on. The platform
 * and the instruction sets' target attributes (each function carries its level's, so every unit
 * builds with portable flags; the kernel table, filled for the level flags, picks one at run
 * time), the GGML type ids and their block sizes (F32, F16, BF16; blocks of 32:
 * Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL; of 256: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS, IQ3_XXS, IQ3_S),
 * f16/bf16 conversion,
 * unaligned reads, the per-thread scratch buffers' growth, fast mode's 8-bit activation
 * blocks, and `mat`: one matrix as the kernels address it. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>  /* offsetof: the records' layouts (python_module.c); x86 builds got it through immintrin.h */
#include <stdint.h>
#include <string.h>
#include <math.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define HAVE_X86 1
#define AVX2 __attribute__((target("avx2,fma,f16c")))
/* AVX-512 with VNNI (vpdpbusd, EVEX): fast mode's integer dots (blocks_avx512.c) */
#define VNNI __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))
/* the 256-bit vpdpbusd levels (interleaved_256.c): VEX (AVX-VNNI), and EVEX on AVX-512 VNNI CPUs */
#define AVXVNNI __attribute__((target("avx2,fma,f16c,avxvnni")))
#define VNNI256 __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512vnni")))
/* VNNI with AVX512_VBMI (vpermi2b, vpmultishiftqb): IQ3_XXS's and IQ3_S's grid lookups, 64 at once (blocks_avx512.c) */
#define VBMI __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi")))
#else
#define HAVE_X86 0
#endif
/* inlined whatever the compiler's budget: tiles with a constant count keep their accumulators
 * in registers (blocks_avx2.c) */
#define INLINE inline __attribute__((always_inline))

/* GGML type ids (gguf.GGMLQuantizationType) */
enum { T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q8_0 = 8, T_Q2_K = 10, T_Q3_K = 11, T_Q4_K = 12, T_Q5_K = 13,
       T_Q6_K = 14, T_BF16 = 30 };
/* blocks of 32: Q5_0, Q5_1, IQ4_NL (4-bit indices into a 16-value codebook); of 256: IQ4_XS */
enum { T_Q5_0 = 6, T_Q5_1 = 7, T_IQ4_NL = 20, T_IQ4_XS = 23 };
/* of 256: IQ3_XXS and IQ3_S (3-bit values from grids of 4, signs apart; blocks_generic.c) */
enum { T_IQ3_XXS = 18, T_IQ3_S = 21 };
/* blocks of 32: MXFP4 (gpt-oss's experts: E2M1 4-bit values as IQ4_NL's nibbles, an E8M0 scale byte) */
enum { T_MXFP4 = 39 };
#define QK 32
#define QKK 256  /* values per block of the K-quants (and IQ4_XS) */
#define MAXB 16  /* most tokens of a small batch (matmul, ffn_batch): accumulators live on the stack */
#define MAXG 16  /* query heads per SIMD call (a larger GQA group goes in turns) */

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

/* MXFP4's E8M0 scale byte e as ggml reads it (ggml_e8m0_to_fp32_half): 2^(e - 128), half of
 * E8M0's 2^(e - 127) because its codebook holds the E2M1 values doubled; e 0 and 1 are the
 * float32 subnormals 2^-128 and 2^-127 */
static inline float e8m0_half(uint8_t e) {
    uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
static inline int32_t rd32(const void *p) { int32_t v; memcpy(&v, p, 4); return v; }

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

/* ---- types and block sizes ------------------------------------------------------------------ */

/* What the kernels know of each type, indexed by its GGML id (ggml's type_traits, as data):
 * values per block, bytes per block, and its family, read instead of a switch or a chain of
 * comparisons wherever a type's facts are asked. An id outside the table, or a type the kernels
 * do not read, has 0 bytes (type_bytes: the entry points' check). */
enum { TF_KQUANT = 1,  /* blocks of 256 values (8 activation blocks each): the K-quants, IQ4_XS, IQ3_XXS, IQ3_S (kunpack) */
       TF_K23 = 2,     /* Q2_K and Q3_K: sub-blocks of 16 and, with AVX2, fast mode's own kernels (k23_*) */
       TF_IQ3 = 4,     /* IQ3_XXS and IQ3_S (grid values) */
       TF_X16 = 8,     /* takes the X16 layout (interleave) */
       TF_R16 = 16 };  /* takes the R16 layout (interleave_blocks) */
typedef struct { int16_t block, bytes; int flags; } type_traits;
#define N_TYPES 40
static const type_traits TYPES[N_TYPES] = {
    [T_F32] = {1, 4, 0}, [T_F16] = {1, 2, 0}, [T_BF16] = {1, 2, 0},
    [T_Q4_0] = {QK, 18, TF_X16 | TF_R16}, [T_Q4_1] = {QK, 20, TF_X16 | TF_R16}, [T_Q8_0] = {QK, 34, TF_X16 | TF_R16},
    [T_Q5_0] = {QK, 22, TF_X16}, [T_Q5_1] = {QK, 24, TF_X16}, [T_IQ4_NL] = {QK, 18, TF_X16},
    [T_Q2_K] = {QKK, 84, TF_KQUANT | TF_K23 | TF_X16}, [T_Q3_K] = {QKK, 110, TF_KQUANT | TF_K23 | TF_X16},
    [T_Q4_K] = {QKK, 144, TF_KQUANT | TF_X16}, [T_Q5_K] = {QKK, 176, TF_KQUANT}, [T_Q6_K] = {QKK, 210, TF_KQUANT | TF_X16},
    [T_IQ4_XS] = {QKK, 136, TF_KQUANT | TF_X16},
    [T_IQ3_XXS] = {QKK, 98, TF_KQUANT | TF_IQ3}, [T_IQ3_S] = {QKK, 110, TF_KQUANT | TF_IQ3},
    [T_MXFP4] = {QK, 17, TF_X16},
};
/* t's entry; ids the table lacks read as an empty entry (0 bytes: not a type the kernels take) */
static inline type_traits traits(int t) {
    static const type_traits none = {0, 0, 0};
    return t >= 0 && t < N_TYPES ? TYPES[t] : none;
}
static inline int is_iq3(int t) { return traits(t).flags & TF_IQ3; }
static inline int is_kquant(int t) { return traits(t).flags & TF_KQUANT; }
static inline int is_k23(int t) { return traits(t).flags & TF_K23; }
static inline int block_size(int t) { return traits(t).block; }
static inline int type_bytes(int t) { return traits(t).bytes; }  /* bytes of one block */
/* quantized types: fast mode quantizes the activation to q8 blocks */
static inline int is_quant(int t) { return block_size(t) >= QK; }

/* An activation quantized for fast mode: per block of 32, int8 values, their float scale and
 * the sum of the int8 values (Q4_0's -8 and Q5_0's -16 offsets, Q4_1's and Q5_1's mins need it). */
typedef struct { float d; int32_t s; int8_t q[QK]; } q8blk;

/* Fast mode with VNNI: a token's q8 blocks 2i and 2i+1 as its steps read them (vnni_pack) */
typedef struct { _Alignas(64) int8_t q[2 * QK]; } xpair;

/* ---- a matrix and the level in use ---------------------------------------------------------- */

/* How a matrix's rows lie in memory (mat.layout, sparsecore.kernels' FILE_LAYOUT, X16, R16):
 *   L_FILE: the file's rows of blocks, as GGUF holds them;
 *   L_X16: interleaved rows, 16 rows side by side: a Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, Q4_K,
 *     Q6_K, IQ4_XS, Q2_K or Q3_K matrix
 *     repacked in memory of the process's own for fast mode's dense products (interleave in
 *     interleaved_generic.c, FileMatrix.interleave); no single rows (no row_at, no row lists);
 *   L_R16: each row's blocks interleaved 16 by 16 within the row: a Q4_0, Q4_1 or Q8_0 matrix
 *     repacked likewise for fast mode's products of rows picked one by one
 *     (FileMatrix.interleave_blocks). Each row keeps its place and its bytes (row_at works);
 *     every 16 consecutive blocks of it (512 values) are laid out as X16 lays out 16 rows'
 *     block, the block standing for the row.
 * The type is the file's in every layout (its block size, a row's bytes: R16's rows are the
 * file's size).
 *   L_COLS: an input-major copy of a sub-matrix (rows [r0, r0 + R), columns [c0, c0 + C)) of a
 *     Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K or Q6_K matrix, held beside the matrix in any of the layouts above as its
 *     "twin" (mat.cols; cols_generic.c says its bytes): per block of 32 columns the R rows'
 *     scales, then 32 channel rows, each one input's R values, so that a one-token product
 *     whose input j is skipped (|x_j| <= the twin's threshold: TEAL's input sparsity) skips
 *     that channel's R/2 contiguous bytes. Never a matrix's own layout: the dispatch
 *     (row_loops.c's cols_take) runs a product on the twin where it applies, on `base`
 *     otherwise. */
enum { L_FILE = 0, L_X16 = 1, L_R16 = 2, L_COLS = 3 };

typedef struct {  /* one matrix: rows of `stride` bytes, values in the file's type `t`, laid out as `layout` */
    const uint8_t *base;
    int64_t stride;
    int t, layout;
    const void *cols;  /* its input-major twin's header (cols_hdr, layout L_COLS), or NULL */
} mat;

static inline int is_x16(mat m) { return m.layout == L_X16; }
static inline int is_r16(mat m) { return m.layout == L_R16; }
/* the types each repacked layout takes */
static inline int x16_type(int t) { return traits(t).flags & TF_X16; }
static inline int r16_type(int t) { return traits(t).flags & TF_R16; }

static inline const uint8_t *row_at(mat m, int64_t r, int64_t col0) {
    return m.base + r * m.stride + (col0 / block_size(m.t)) * type_bytes(m.t);
}
/* m with row r0 as its row 0 (a shard's rows by their offsets in it) */
static inline mat shifted(mat m, int64_t r0) {
    m.base += r0 * m.stride;
    return m;
}

/* The level in use: set by python_module.c's set_isa (and the module's init), which defines them;
 * shared by every compilation unit (the instruction-set units read them when they fill the
 * kernel table: use_dp256, use_vbmi). Hidden from outside the extension (-fvisibility=hidden). */
extern int use_avx2;
extern int use_vnni;  /* fast mode's integer dots with AVX-512 VNNI (implies use_avx2) */
extern int use_vbmi;  /* with use_vnni, where the CPU has AVX512_VBMI: IQ3_XXS's and IQ3_S's VNNI products */
/* the interleaved layouts' integer sums with 256-bit vpdpbusd (level "avxvnni", implies use_avx2):
 * 1 VEX-encoded (CPUs with AVX-VNNI), 2 EVEX-encoded (CPUs with AVX-512 VNNI: the same code,
 * tested there) */
extern int use_dp256;
