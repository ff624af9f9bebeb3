/* _kernels.c, part: the row loops: one token's and a small batch's products over a matrix's rows
 * (matvec, matmul), and its rows dequantized. */

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

/* y[i] = row(rows[i] or start + i)[col0 : col0 + n] . x for i < n_rows; on m's input-major
 * twin where it applies (cols_take: no row list, the twin's ranges, its threshold >= 0) */
static void matvec(mat m, const int32_t *rows, int64_t start, int64_t n_rows, int64_t col0, int n,
                   const float *x, const q8blk *xq, int fast, float *y) {
    const cols_hdr *tw = cols_take(m, rows, start, n_rows, col0, n);  /* its input-major twin, where it applies */
    if (tw && cols_products(tw, x, xq, fast, y) >= 0) return;
    if (is_x16(m)) { x16_products(m, start, n_rows, col0, n, xq, 0, 1, y, 1); return; }
    int64_t bytes = (int64_t)n / block_size(m.t) * type_bytes(m.t);
    int partial = n * type_bytes(m.t) / block_size(m.t) < m.stride || rows != NULL;
    const xpair *xp = pack_x(m, xq, 0, n, 1, fast);
#if HAVE_X86
    if (is_r16(m) && xp && col0 == 0) { r16_rows(m, rows, start, n_rows, xp, n / QK, y); return; }
#endif
    for (int64_t i = 0; i < n_rows; i++) {
        int64_t r = rows ? rows[i] : start + i;
        if (partial && i + PREFETCH_ROWS < n_rows)
            prefetch_row(row_at(m, rows ? rows[i + PREFETCH_ROWS] : start + i + PREFETCH_ROWS, col0), bytes);
        y[i] = dot_any(m, row_at(m, r, col0), x, xq, xp, n, fast);
    }
}

#define TILE_ROWS_B 8      /* tokens per pass over a block of rows (TILE_V of the VNNI kernel) */
#define MATMUL_ROW_BLOCK 256 /* rows per block: read again per tile of tokens from L2 (256 rows of the 1.1B shape: 0.3 MB) */

/* matvec for B tokens (2..MAXB; continuous batching): Y[b][i] = row_i[col0 : col0 + n] . x_b,
 * each row read once for all B. Token b's x at x + b ldx, its q8 blocks (fast) at xq + b ldq,
 * its outputs at y + b ldy. Per token the same float operations as matvec. */
static void matmul(mat m, const int32_t *rows, int64_t start, int64_t n_rows, int64_t col0, int n,
                   const float *x, int64_t ldx, const q8blk *xq, int64_t ldq, int B, int fast, float *y, int64_t ldy) {
    if (B == 1) {  /* one token: matvec's twin (a batch reads every input of the original, densely) */
        const cols_hdr *tw = cols_take(m, rows, start, n_rows, col0, n);
        if (tw && cols_products(tw, x, xq, fast, y) >= 0) return;
    }
    if (is_x16(m)) { x16_products(m, start, n_rows, col0, n, xq, ldq, B, y, ldy); return; }
    int64_t bytes = (int64_t)n / block_size(m.t) * type_bytes(m.t);
    int partial = n * type_bytes(m.t) / block_size(m.t) < m.stride || rows != NULL;
    const xpair *xp = pack_x(m, xq, ldq, n, B, fast);
    /* More tokens than a tile: rows in blocks, each block read once per tile of tokens (again
     * from L2), so that a tile's activations stay in L1: a row read for all 16 tokens at once
     * pushed them out (1.1B shape: 16 tokens cost 2.5 times 8; in blocks of 256 rows, 1.9
     * times; 16 rows, 2.2). A token's floats are the same whatever its tile. */
    int64_t block = B > TILE_ROWS_B ? MATMUL_ROW_BLOCK : n_rows;
    for (int64_t i0 = 0; i0 < n_rows; i0 += block) {
        int64_t i1 = i0 + block < n_rows ? i0 + block : n_rows;
        for (int b0 = 0; b0 < B; b0 += TILE_ROWS_B) {
            int nt = B - b0 < TILE_ROWS_B ? B - b0 : TILE_ROWS_B;
            const xpair *xpt = xp ? xp + b0 * xp_ld_any(m, n) : NULL;
            for (int64_t i = i0; i < i1; i++) {
                int64_t r = rows ? rows[i] : start + i;
                if (partial && i + PREFETCH_ROWS < n_rows && b0 == 0)
                    prefetch_row(row_at(m, rows ? rows[i + PREFETCH_ROWS] : start + i + PREFETCH_ROWS, col0), bytes);
                dots_any(m, row_at(m, r, col0), x + b0 * ldx, ldx, xq + b0 * ldq, ldq, xpt, n, fast, nt, B == 1,
                         y + (int64_t)b0 * ldy + i, ldy);
            }
        }
    }
}

/* matmul, or for one token matvec, its own faster path (the same floats: see matmul) */
static inline void products(mat m, const int32_t *rows, int64_t start, int64_t n_rows, int64_t col0, int n,
                            const float *x, int64_t ldx, const q8blk *xq, int64_t ldq, int B, int fast, float *y,
                            int64_t ldy) {
    if (B == 1) matvec(m, rows, start, n_rows, col0, n, x, xq, fast, y);
    else matmul(m, rows, start, n_rows, col0, n, x, ldx, xq, ldq, B, fast, y, ldy);
}

/* Dequantize rows (or a range) restricted to columns [col0, col0 + n) into out (n_rows x n) */
static void dequant_rows(mat m, const int32_t *rows, int64_t start, int64_t n_rows, int64_t col0, int n, float *out) {
    if (is_x16(m)) { x16_dequant_rows(m, start, n_rows, col0, n, out); return; }  /* rows is NULL: X16 matrices take ranges on groups only */
    if (is_r16(m)) { r16_dequant_rows(m, rows, start, n_rows, n, out); return; }  /* whole rows: col0 0 */
    dequant_fn row = kern.dequant[m.t];  /* the level's, where it has one (F16, BF16 at AVX2) */
    for (int64_t i = 0; i < n_rows; i++) row(row_at(m, rows ? rows[i] : start + i, col0), n, out + i * n);
}
