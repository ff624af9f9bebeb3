/* _kernels.c (and the SIMD units, for its helpers), part:
 * the file's block formats in portable C: the K-quants' (and IQ4_XS's, IQ3_XXS's,
 * IQ3_S's) unpacking, Q5_0's, Q5_1's and IQ4_NL's, fast mode's activation quantization, the exact and
 * fast dot products, axpy and dequantization. */

/* ---- blocks of 32 with 5-bit values or a codebook (ggml's layouts) ---------------------------
 * Q5_0 (22 bytes): f16 d, qh[4] (bit j of the little-endian word: value j's fifth bit), qs[16]
 *   (value j < 16 in qs[j]'s low nibble, value j + 16 in its high one); value = d (q - 16).
 * Q5_1 (24 bytes): f16 d, f16 m, qh[4], qs[16] as Q5_0; value = d q + m.
 * IQ4_NL (18 bytes): f16 d, qs[16] nibbles as Q4_0's, each an index into the int8 codebook
 *   kvalues; value = d kvalues[i].
 * IQ4_XS (136 bytes, 256 values): f16 d, u16 scales_h, scales_l[4], qs[128]; sub-block j of 32
 *   has the 6-bit scale ls = nibble j of scales_l | bits 2j..2j+1 of scales_h << 4, its values
 *   IQ4_NL's nibbles in qs[16 j ..+16]; value = (d (ls - 32)) kvalues[i]. */
static const int8_t kvalues_iq4nl[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
/* MXFP4 (17 bytes): u8 e, qs[16] nibbles as Q4_0's, each an index into the E2M1 values doubled;
 *   value = e8m0_half(e) kvalues_mxfp4[i] (gguf-py's and ggml's dequantization) */
static const int8_t kvalues_mxfp4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
/* the scale of a Q5_0, Q5_1, IQ4_NL or MXFP4 block (unpack32's types) */
static inline float q32_d(int t, const uint8_t *w) { return t == T_MXFP4 ? e8m0_half(w[0]) : f16_to_f32(rd16(w)); }

/* One Q5_0, Q5_1, IQ4_NL or MXFP4 block's 32 values as int8: Q5_0 q - 16, Q5_1 q (0..31), IQ4_NL
 * and MXFP4 their codebook's */
static inline void unpack32(int t, const uint8_t *w, int8_t *q) {
    if (t == T_IQ4_NL || t == T_MXFP4) {
        const int8_t *kv = t == T_MXFP4 ? kvalues_mxfp4 : kvalues_iq4nl;
        const uint8_t *qs = w + (t == T_MXFP4 ? 1 : 2);
        for (int j = 0; j < 16; j++) { q[j] = kv[qs[j] & 15]; q[j + 16] = kv[qs[j] >> 4]; }
        return;
    }
    int off = t == T_Q5_1 ? 4 : 2, zero = t == T_Q5_0 ? 16 : 0;
    uint32_t qh = (uint32_t)rd32(w + off);
    for (int j = 0; j < 16; j++) {
        q[j] = (int8_t)(((w[off + 4 + j] & 15) | ((qh >> j) & 1) << 4) - zero);
        q[j + 16] = (int8_t)(((w[off + 4 + j] >> 4) | ((qh >> (j + 16)) & 1) << 4) - zero);
    }
}
static inline int is_q32x(int t) { return t == T_Q5_0 || t == T_Q5_1 || t == T_IQ4_NL || t == T_MXFP4; }  /* unpack32's types */

/* ---- IQ3_XXS and IQ3_S (ggml's layouts), 256 values each ------------------------------------
 * Sub-block j of 32 values: 8 grid indices, each naming 4 unsigned values (one uint32 of a grid,
 * its bytes in order), and 32 signs (bit v set: value v negative).
 * IQ3_XXS (98 bytes): f16 d, qs[64] (sub-block j's indices qs[8 j ..+8] into iq3xxs_grid: values
 *   4..62), then per sub-block a little-endian uint32 a: scale (d (0.5 + (a >> 28))) 0.5; the
 *   signs of values 8 g ..+8 are ksigns_iq3[(a >> 7 g) & 127] (7 sign bits, the eighth their
 *   parity).
 * IQ3_S (110 bytes): f16 d, qs[64], qh[8], signs[32], scales[4]: index i = qs[i] | (bit i % 8 of
 *   qh[i / 8]) << 8 into iq3s_grid (odd values 1..15); sub-block j's signs the word at
 *   signs[4 j]; scale d (1 + 2 (nibble j of scales)).
 * Value = scale (grid value, signed): as gguf-py, which multiplies the scale by the grid value
 * and then by the sign. The grids and ksigns are gguf-py's (gguf.quants IQ3_XXS, IQ3_S, IQ2_XXS). */
static const uint32_t iq3xxs_grid[256] = {
    0x04040404, 0x04040414, 0x04040424, 0x04040c0c, 0x04040c1c, 0x04040c3e, 0x04041404, 0x04041414,
    0x04041c0c, 0x04042414, 0x04043e1c, 0x04043e2c, 0x040c040c, 0x040c041c, 0x040c0c04, 0x040c0c14,
    0x040c140c, 0x040c142c, 0x040c1c04, 0x040c1c14, 0x040c240c, 0x040c2c24, 0x040c3e04, 0x04140404,
    0x04140414, 0x04140424, 0x04140c0c, 0x04141404, 0x04141414, 0x04141c0c, 0x04141c1c, 0x04141c3e,
    0x04142c0c, 0x04142c3e, 0x04143e2c, 0x041c040c, 0x041c043e, 0x041c0c04, 0x041c0c14, 0x041c142c,
    0x041c3e04, 0x04240c1c, 0x04241c3e, 0x04242424, 0x04242c3e, 0x04243e1c, 0x04243e2c, 0x042c040c,
    0x042c043e, 0x042c1c14, 0x042c2c14, 0x04341c2c, 0x04343424, 0x043e0c04, 0x043e0c24, 0x043e0c34,
    0x043e241c, 0x043e340c, 0x0c04040c, 0x0c04041c, 0x0c040c04, 0x0c040c14, 0x0c04140c, 0x0c04141c,
    0x0c041c04, 0x0c041c14, 0x0c041c24, 0x0c04243e, 0x0c042c04, 0x0c0c0404, 0x0c0c0414, 0x0c0c0c0c,
    0x0c0c1404, 0x0c0c1414, 0x0c14040c, 0x0c14041c, 0x0c140c04, 0x0c140c14, 0x0c14140c, 0x0c141c04,
    0x0c143e14, 0x0c1c0404, 0x0c1c0414, 0x0c1c1404, 0x0c1c1c0c, 0x0c1c2434, 0x0c1c3434, 0x0c24040c,
    0x0c24042c, 0x0c242c04, 0x0c2c1404, 0x0c2c1424, 0x0c2c2434, 0x0c2c3e0c, 0x0c34042c, 0x0c3e1414,
    0x0c3e2404, 0x14040404, 0x14040414, 0x14040c0c, 0x14040c1c, 0x14041404, 0x14041414, 0x14041434,
    0x14041c0c, 0x14042414, 0x140c040c, 0x140c041c, 0x140c042c, 0x140c0c04, 0x140c0c14, 0x140c140c,
    0x140c1c04, 0x140c341c, 0x140c343e, 0x140c3e04, 0x14140404, 0x14140414, 0x14140c0c, 0x14140c3e,
    0x14141404, 0x14141414, 0x14141c3e, 0x14142404, 0x14142c2c, 0x141c040c, 0x141c0c04, 0x141c0c24,
    0x141c3e04, 0x141c3e24, 0x14241c2c, 0x14242c1c, 0x142c041c, 0x142c143e, 0x142c240c, 0x142c3e24,
    0x143e040c, 0x143e041c, 0x143e0c34, 0x143e242c, 0x1c04040c, 0x1c040c04, 0x1c040c14, 0x1c04140c,
    0x1c04141c, 0x1c042c04, 0x1c04342c, 0x1c043e14, 0x1c0c0404, 0x1c0c0414, 0x1c0c1404, 0x1c0c1c0c,
    0x1c0c2424, 0x1c0c2434, 0x1c14040c, 0x1c14041c, 0x1c140c04, 0x1c14142c, 0x1c142c14, 0x1c143e14,
    0x1c1c0c0c, 0x1c1c1c1c, 0x1c241c04, 0x1c24243e, 0x1c243e14, 0x1c2c0404, 0x1c2c0434, 0x1c2c1414,
    0x1c2c2c2c, 0x1c340c24, 0x1c341c34, 0x1c34341c, 0x1c3e1c1c, 0x1c3e3404, 0x24040424, 0x24040c3e,
    0x24041c2c, 0x24041c3e, 0x24042c1c, 0x24042c3e, 0x240c3e24, 0x24141404, 0x24141c3e, 0x24142404,
    0x24143404, 0x24143434, 0x241c043e, 0x241c242c, 0x24240424, 0x24242c0c, 0x24243424, 0x242c142c,
    0x242c241c, 0x242c3e04, 0x243e042c, 0x243e0c04, 0x243e0c14, 0x243e1c04, 0x2c040c14, 0x2c04240c,
    0x2c043e04, 0x2c0c0404, 0x2c0c0434, 0x2c0c1434, 0x2c0c2c2c, 0x2c140c24, 0x2c141c14, 0x2c143e14,
    0x2c1c0414, 0x2c1c2c1c, 0x2c240c04, 0x2c24141c, 0x2c24143e, 0x2c243e14, 0x2c2c0414, 0x2c2c1c0c,
    0x2c342c04, 0x2c3e1424, 0x2c3e2414, 0x34041424, 0x34042424, 0x34042434, 0x34043424, 0x340c140c,
    0x340c340c, 0x34140c3e, 0x34143424, 0x341c1c04, 0x341c1c34, 0x34242424, 0x342c042c, 0x342c2c14,
    0x34341c1c, 0x343e041c, 0x343e140c, 0x3e04041c, 0x3e04042c, 0x3e04043e, 0x3e040c04, 0x3e041c14,
    0x3e042c14, 0x3e0c1434, 0x3e0c2404, 0x3e140c14, 0x3e14242c, 0x3e142c14, 0x3e1c0404, 0x3e1c0c2c,
    0x3e1c1c1c, 0x3e1c3404, 0x3e24140c, 0x3e24240c, 0x3e2c0404, 0x3e2c0414, 0x3e2c1424, 0x3e341c04,
};
static const uint32_t iq3s_grid[512] = {
    0x01010101, 0x01010103, 0x01010105, 0x0101010b, 0x0101010f, 0x01010301, 0x01010303, 0x01010305,
    0x01010309, 0x0101030d, 0x01010501, 0x01010503, 0x0101050b, 0x01010707, 0x01010901, 0x01010905,
    0x0101090b, 0x0101090f, 0x01010b03, 0x01010b07, 0x01010d01, 0x01010d05, 0x01010f03, 0x01010f09,
    0x01010f0f, 0x01030101, 0x01030103, 0x01030105, 0x01030109, 0x01030301, 0x01030303, 0x0103030b,
    0x01030501, 0x01030507, 0x0103050f, 0x01030703, 0x0103070b, 0x01030909, 0x01030d03, 0x01030d0b,
    0x01030f05, 0x01050101, 0x01050103, 0x0105010b, 0x0105010f, 0x01050301, 0x01050307, 0x0105030d,
    0x01050503, 0x0105050b, 0x01050701, 0x01050709, 0x01050905, 0x0105090b, 0x0105090f, 0x01050b03,
    0x01050b07, 0x01050f01, 0x01050f07, 0x01070107, 0x01070303, 0x0107030b, 0x01070501, 0x01070505,
    0x01070703, 0x01070707, 0x0107070d, 0x01070909, 0x01070b01, 0x01070b05, 0x01070d0f, 0x01070f03,
    0x01070f0b, 0x01090101, 0x01090307, 0x0109030f, 0x01090503, 0x01090509, 0x01090705, 0x01090901,
    0x01090907, 0x01090b03, 0x01090f01, 0x010b0105, 0x010b0109, 0x010b0501, 0x010b0505, 0x010b050d,
    0x010b0707, 0x010b0903, 0x010b090b, 0x010b090f, 0x010b0d0d, 0x010b0f07, 0x010d010d, 0x010d0303,
    0x010d0307, 0x010d0703, 0x010d0b05, 0x010d0f03, 0x010f0101, 0x010f0105, 0x010f0109, 0x010f0501,
    0x010f0505, 0x010f050d, 0x010f0707, 0x010f0b01, 0x010f0b09, 0x03010101, 0x03010103, 0x03010105,
    0x03010109, 0x03010301, 0x03010303, 0x03010307, 0x0301030b, 0x0301030f, 0x03010501, 0x03010505,
    0x03010703, 0x03010709, 0x0301070d, 0x03010b09, 0x03010b0d, 0x03010d03, 0x03010f05, 0x03030101,
    0x03030103, 0x03030107, 0x0303010d, 0x03030301, 0x03030309, 0x03030503, 0x03030701, 0x03030707,
    0x03030903, 0x03030b01, 0x03030b05, 0x03030f01, 0x03030f0d, 0x03050101, 0x03050305, 0x0305030b,
    0x0305030f, 0x03050501, 0x03050509, 0x03050705, 0x03050901, 0x03050907, 0x03050b0b, 0x03050d01,
    0x03050f05, 0x03070103, 0x03070109, 0x0307010f, 0x03070301, 0x03070307, 0x03070503, 0x0307050f,
    0x03070701, 0x03070709, 0x03070903, 0x03070d05, 0x03070f01, 0x03090107, 0x0309010b, 0x03090305,
    0x03090309, 0x03090703, 0x03090707, 0x03090905, 0x0309090d, 0x03090b01, 0x03090b09, 0x030b0103,
    0x030b0301, 0x030b0307, 0x030b0503, 0x030b0701, 0x030b0705, 0x030b0b03, 0x030d0501, 0x030d0509,
    0x030d050f, 0x030d0909, 0x030d090d, 0x030f0103, 0x030f0107, 0x030f0301, 0x030f0305, 0x030f0503,
    0x030f070b, 0x030f0903, 0x030f0d05, 0x030f0f01, 0x05010101, 0x05010103, 0x05010107, 0x0501010b,
    0x0501010f, 0x05010301, 0x05010305, 0x05010309, 0x0501030d, 0x05010503, 0x05010507, 0x0501050f,
    0x05010701, 0x05010705, 0x05010903, 0x05010907, 0x0501090b, 0x05010b01, 0x05010b05, 0x05010d0f,
    0x05010f01, 0x05010f07, 0x05010f0b, 0x05030101, 0x05030105, 0x05030301, 0x05030307, 0x0503030f,
    0x05030505, 0x0503050b, 0x05030703, 0x05030709, 0x05030905, 0x05030b03, 0x05050103, 0x05050109,
    0x0505010f, 0x05050503, 0x05050507, 0x05050701, 0x0505070f, 0x05050903, 0x05050b07, 0x05050b0f,
    0x05050f03, 0x05050f09, 0x05070101, 0x05070105, 0x0507010b, 0x05070303, 0x05070505, 0x05070509,
    0x05070703, 0x05070707, 0x05070905, 0x05070b01, 0x05070d0d, 0x05090103, 0x0509010f, 0x05090501,
    0x05090507, 0x05090705, 0x0509070b, 0x05090903, 0x05090f05, 0x05090f0b, 0x050b0109, 0x050b0303,
    0x050b0505, 0x050b070f, 0x050b0901, 0x050b0b07, 0x050b0f01, 0x050d0101, 0x050d0105, 0x050d010f,
    0x050d0503, 0x050d0b0b, 0x050d0d03, 0x050f010b, 0x050f0303, 0x050f050d, 0x050f0701, 0x050f0907,
    0x050f0b01, 0x07010105, 0x07010303, 0x07010307, 0x0701030b, 0x0701030f, 0x07010505, 0x07010703,
    0x07010707, 0x0701070b, 0x07010905, 0x07010909, 0x0701090f, 0x07010b03, 0x07010d07, 0x07010f03,
    0x07030103, 0x07030107, 0x0703010b, 0x07030309, 0x07030503, 0x07030507, 0x07030901, 0x07030d01,
    0x07030f05, 0x07030f0d, 0x07050101, 0x07050305, 0x07050501, 0x07050705, 0x07050709, 0x07050b01,
    0x07070103, 0x07070301, 0x07070309, 0x07070503, 0x07070507, 0x0707050f, 0x07070701, 0x07070903,
    0x07070907, 0x0707090f, 0x07070b0b, 0x07070f07, 0x07090107, 0x07090303, 0x0709030d, 0x07090505,
    0x07090703, 0x07090b05, 0x07090d01, 0x07090d09, 0x070b0103, 0x070b0301, 0x070b0305, 0x070b050b,
    0x070b0705, 0x070b0909, 0x070b0b0d, 0x070b0f07, 0x070d030d, 0x070d0903, 0x070f0103, 0x070f0107,
    0x070f0501, 0x070f0505, 0x070f070b, 0x09010101, 0x09010109, 0x09010305, 0x09010501, 0x09010509,
    0x0901050f, 0x09010705, 0x09010903, 0x09010b01, 0x09010f01, 0x09030105, 0x0903010f, 0x09030303,
    0x09030307, 0x09030505, 0x09030701, 0x0903070b, 0x09030907, 0x09030b03, 0x09030b0b, 0x09050103,
    0x09050107, 0x09050301, 0x0905030b, 0x09050503, 0x09050707, 0x09050901, 0x09050b0f, 0x09050d05,
    0x09050f01, 0x09070109, 0x09070303, 0x09070307, 0x09070501, 0x09070505, 0x09070703, 0x0907070b,
    0x09090101, 0x09090105, 0x09090509, 0x0909070f, 0x09090901, 0x09090f03, 0x090b010b, 0x090b010f,
    0x090b0503, 0x090b0d05, 0x090d0307, 0x090d0709, 0x090d0d01, 0x090f0301, 0x090f030b, 0x090f0701,
    0x090f0907, 0x090f0b03, 0x0b010105, 0x0b010301, 0x0b010309, 0x0b010505, 0x0b010901, 0x0b010909,
    0x0b01090f, 0x0b010b05, 0x0b010d0d, 0x0b010f09, 0x0b030103, 0x0b030107, 0x0b03010b, 0x0b030305,
    0x0b030503, 0x0b030705, 0x0b030f05, 0x0b050101, 0x0b050303, 0x0b050507, 0x0b050701, 0x0b05070d,
    0x0b050b07, 0x0b070105, 0x0b07010f, 0x0b070301, 0x0b07050f, 0x0b070909, 0x0b070b03, 0x0b070d0b,
    0x0b070f07, 0x0b090103, 0x0b090109, 0x0b090501, 0x0b090705, 0x0b09090d, 0x0b0b0305, 0x0b0b050d,
    0x0b0b0b03, 0x0b0b0b07, 0x0b0d0905, 0x0b0f0105, 0x0b0f0109, 0x0b0f0505, 0x0d010303, 0x0d010307,
    0x0d01030b, 0x0d010703, 0x0d010707, 0x0d010d01, 0x0d030101, 0x0d030501, 0x0d03050f, 0x0d030d09,
    0x0d050305, 0x0d050709, 0x0d050905, 0x0d050b0b, 0x0d050d05, 0x0d050f01, 0x0d070101, 0x0d070309,
    0x0d070503, 0x0d070901, 0x0d09050b, 0x0d090907, 0x0d090d05, 0x0d0b0101, 0x0d0b0107, 0x0d0b0709,
    0x0d0b0d01, 0x0d0d010b, 0x0d0d0901, 0x0d0f0303, 0x0d0f0307, 0x0f010101, 0x0f010109, 0x0f01010f,
    0x0f010501, 0x0f010505, 0x0f01070d, 0x0f010901, 0x0f010b09, 0x0f010d05, 0x0f030105, 0x0f030303,
    0x0f030509, 0x0f030907, 0x0f03090b, 0x0f050103, 0x0f050109, 0x0f050301, 0x0f05030d, 0x0f050503,
    0x0f050701, 0x0f050b03, 0x0f070105, 0x0f070705, 0x0f07070b, 0x0f070b07, 0x0f090103, 0x0f09010b,
    0x0f090307, 0x0f090501, 0x0f090b01, 0x0f0b0505, 0x0f0b0905, 0x0f0d0105, 0x0f0d0703, 0x0f0f0101,
};
static const uint8_t ksigns_iq3[128] = {
    0x00, 0x81, 0x82, 0x03, 0x84, 0x05, 0x06, 0x87, 0x88, 0x09, 0x0a, 0x8b, 0x0c, 0x8d, 0x8e, 0x0f,
    0x90, 0x11, 0x12, 0x93, 0x14, 0x95, 0x96, 0x17, 0x18, 0x99, 0x9a, 0x1b, 0x9c, 0x1d, 0x1e, 0x9f,
    0xa0, 0x21, 0x22, 0xa3, 0x24, 0xa5, 0xa6, 0x27, 0x28, 0xa9, 0xaa, 0x2b, 0xac, 0x2d, 0x2e, 0xaf,
    0x30, 0xb1, 0xb2, 0x33, 0xb4, 0x35, 0x36, 0xb7, 0xb8, 0x39, 0x3a, 0xbb, 0x3c, 0xbd, 0xbe, 0x3f,
    0xc0, 0x41, 0x42, 0xc3, 0x44, 0xc5, 0xc6, 0x47, 0x48, 0xc9, 0xca, 0x4b, 0xcc, 0x4d, 0x4e, 0xcf,
    0x50, 0xd1, 0xd2, 0x53, 0xd4, 0x55, 0x56, 0xd7, 0xd8, 0x59, 0x5a, 0xdb, 0x5c, 0xdd, 0xde, 0x5f,
    0x60, 0xe1, 0xe2, 0x63, 0xe4, 0x65, 0x66, 0xe7, 0xe8, 0x69, 0x6a, 0xeb, 0x6c, 0xed, 0xee, 0x6f,
    0xf0, 0x71, 0x72, 0xf3, 0x74, 0xf5, 0xf6, 0x77, 0x78, 0xf9, 0xfa, 0x7b, 0xfc, 0x7d, 0x7e, 0xff,
};

/* the 32 sign bits of sub-block j */
static inline uint32_t iq3_signs(int t, const uint8_t *w, int j) {
    if (t == T_IQ3_S) return (uint32_t)rd32(w + 74 + 4 * j);
    uint32_t a = (uint32_t)rd32(w + 66 + 4 * j);
    return ksigns_iq3[a & 127] | (uint32_t)ksigns_iq3[(a >> 7) & 127] << 8 | (uint32_t)ksigns_iq3[(a >> 14) & 127] << 16 |
           (uint32_t)ksigns_iq3[(a >> 21) & 127] << 24;
}
/* grid word of index i (0..63): values 4 (i % 8) ..+4 of sub-block i / 8 */
static inline uint32_t iq3_grid(int t, const uint8_t *w, int i) {
    if (t == T_IQ3_S) return iq3s_grid[w[2 + i] | ((w[66 + i / 8] >> (i % 8)) & 1) << 8];
    return iq3xxs_grid[w[2 + i]];
}
/* sub-block j's float scale, as gguf-py computes it */
static inline float iq3_scale(int t, const uint8_t *w, int j) {
    float d = f16_to_f32(rd16(w));
    if (t == T_IQ3_S) return d * (float)(1 + 2 * ((w[106 + j / 2] >> (4 * (j & 1))) & 15));
    return d * (0.5f + (float)((uint32_t)rd32(w + 66 + 4 * j) >> 28)) * 0.5f;
}

/* ---- K-quant blocks (ggml's layouts), 256 values each ----------------------------------------
 * Q4_K (144 bytes): f16 d, f16 dmin, 12 bytes of 6-bit scales sc[8] and mins m[8] packed, 128
 *   bytes qs. Sub-block j (32 values) of q: nibbles of qs[32 (j/2) ..+32], low ones for even j,
 *   high ones for odd j. Value = d sc[j] q - dmin m[j].
 * Q5_K (176 bytes): d, dmin, the 12 scale bytes, 32 bytes qh, 128 bytes qs as Q4_K; value i of
 *   sub-block j gets bit j of qh[i] as its fifth bit (q in 0..31).
 * Q6_K (210 bytes): 128 bytes ql (low 4 bits), 64 bytes qh (high 2 bits), int8 sc[16] (one per
 *   16 values), f16 d. Half h (128 values): value 32 k + l (k < 4, l < 32) has low bits
 *   ql[64 h + 32 (k & 1) + l] >> 4 (k >> 1) and high bits qh[32 h + l] >> 2 k; value = d sc (q - 32).
 * Q2_K (84 bytes): 16 bytes sc (per 16 values: scale in the low nibble, min in the high), 64
 *   bytes qs, f16 d, f16 dmin. Value 128 h + 32 k + l: q = qs[32 h + l] >> 2 k & 3;
 *   value = d (sc & 15) q - dmin (sc >> 4).
 * Q3_K (110 bytes): 32 bytes hmask, 64 bytes qs (the low 2 bits, as Q2_K's), 12 bytes of 16
 *   6-bit scales packed, f16 d. Value 32 i + l (i < 8): high bit i of hmask[l], set meaning
 *   no offset: q = low - (bit ? 0 : 4) in -4..3; value = d (sc - 32) q. Scale j: low 4 bits
 *   from byte j % 8 (its high nibble for j >= 8), high 2 bits from byte 8 + j % 4 >> 2 (j / 4). */

/* 6-bit scale and min of sub-block j from Q4_K/Q5_K's 12 packed bytes */
static inline void kscale_min(const uint8_t *s, int j, int *sc, int *m) {
    if (j < 4) { *sc = s[j] & 63; *m = s[j + 4] & 63; }
    else { *sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4); *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4); }
}

/* Q3_K's 6-bit scale j from its 12 packed bytes s, less 32 */
static inline int q3k_scale(const uint8_t *s, int j) {
    return (((s[j % 8] >> (4 * (j / 8))) & 15) | (((s[8 + j % 4] >> (2 * (j / 4))) & 3) << 4)) - 32;
}

/* A Q6_K block's 256 stored 6-bit values (q + 32) in the values' order, read from its bytes
 * (ggml's order: per half n, ql's low then high nibbles of bytes 0..63 are values 0..31,
 * 32..63, 64..95, 96..127, and qh's 2-bit fields 0..3 of byte l their high bits): what the
 * repackings (interleave_q6k, kq_repack) lay out, without kunpack's float scales */
static inline void q6k_values(const uint8_t *w, uint8_t *v) {
    for (int n = 0; n < 2; n++) {
        const uint8_t *ql = w + 64 * n, *qh = w + 128 + 32 * n;
        uint8_t *o = v + 128 * n;
        for (int l = 0; l < 32; l++) {
            o[l] = (uint8_t)((ql[l] & 15) | (qh[l] & 3) << 4);
            o[l + 32] = (uint8_t)((ql[l + 32] & 15) | ((qh[l] >> 2) & 3) << 4);
            o[l + 64] = (uint8_t)((ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4);
            o[l + 96] = (uint8_t)((ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4);
        }
    }
}

/* One K block as int8 values (Q4_K/Q5_K: 0..31, Q6_K: q - 32, Q2_K: 0..3, Q3_K: -4..3, IQ4_XS:
 * the codebook's) and per sub-block float scale and min (value = scl q - mn); returns the
 * sub-block size (32, or 16 for Q6_K, Q2_K, Q3_K). IQ3_XXS, IQ3_S: the grids' values signed. */
static int kunpack(int t, const uint8_t *w, int8_t *q, float *scl, float *mn) {
    if (is_iq3(t)) {  /* the grids' values signed, no min */
        for (int j = 0; j < 8; j++) {
            uint32_t sg = iq3_signs(t, w, j);
            scl[j] = iq3_scale(t, w, j);
            mn[j] = 0.f;
            for (int g = 0; g < 8; g++) {
                uint32_t v = iq3_grid(t, w, 8 * j + g);
                for (int k = 0; k < 4; k++) {
                    int l = 4 * g + k, u = (int)((v >> (8 * k)) & 255);
                    q[32 * j + l] = (int8_t)((sg >> l) & 1 ? -u : u);
                }
            }
        }
        return 32;
    }
    if (t == T_IQ4_XS) {  /* the codebook's values, scale d (ls - 32), no min */
        float d = f16_to_f32(rd16(w));
        int sh = rd16(w + 2);
        for (int j = 0; j < 8; j++) {
            int ls = ((w[4 + j / 2] >> (4 * (j & 1))) & 15) | (((sh >> (2 * j)) & 3) << 4);
            scl[j] = d * (float)(ls - 32);
            mn[j] = 0.f;
            for (int l = 0; l < 16; l++) {
                q[32 * j + l] = kvalues_iq4nl[w[8 + 16 * j + l] & 15];
                q[32 * j + 16 + l] = kvalues_iq4nl[w[8 + 16 * j + l] >> 4];
            }
        }
        return 32;
    }
    if (t == T_Q2_K || t == T_Q3_K) {
        const uint8_t *qs = w + (t == T_Q2_K ? 16 : 32), *hm = w;
        for (int h = 0; h < 2; h++)
            for (int k = 0; k < 4; k++)
                for (int l = 0; l < 32; l++) {
                    int v = (qs[32 * h + l] >> (2 * k)) & 3, i = 4 * h + k;
                    q[32 * i + l] = (int8_t)(t == T_Q2_K ? v : v - ((hm[l] >> i) & 1 ? 0 : 4));
                }
        if (t == T_Q2_K) {
            float d = f16_to_f32(rd16(w + 80)), dmin = f16_to_f32(rd16(w + 82));
            for (int j = 0; j < 16; j++) { scl[j] = d * (float)(w[j] & 15); mn[j] = dmin * (float)(w[j] >> 4); }
        } else {
            float d = f16_to_f32(rd16(w + 108));
            for (int j = 0; j < 16; j++) { scl[j] = d * (float)q3k_scale(w + 96, j); mn[j] = 0.f; }
        }
        return 16;
    }
    if (t == T_Q6_K) {
        const uint8_t *ql = w, *qh = w + 128;
        const int8_t *sc = (const int8_t *)(w + 192);
        float d = f16_to_f32(rd16(w + 208));
        for (int h = 0; h < 2; h++)
            for (int k = 0; k < 4; k++)
                for (int l = 0; l < 32; l++) {
                    int lo = (ql[64 * h + 32 * (k & 1) + l] >> (4 * (k >> 1))) & 15, hi = (qh[32 * h + l] >> (2 * k)) & 3;
                    q[128 * h + 32 * k + l] = (int8_t)((lo | (hi << 4)) - 32);
                }
        for (int j = 0; j < 16; j++) { scl[j] = d * (float)sc[j]; mn[j] = 0.f; }
        return 16;
    }
    float d = f16_to_f32(rd16(w)), dmin = f16_to_f32(rd16(w + 2));
    const uint8_t *qs = w + (t == T_Q5_K ? 48 : 16), *qh = w + 16;
    for (int j = 0; j < 8; j++) {
        int sc, m;
        kscale_min(w + 4, j, &sc, &m);
        scl[j] = d * (float)sc;
        mn[j] = dmin * (float)m;
        for (int l = 0; l < 32; l++) {
            int v = (qs[32 * (j >> 1) + l] >> (4 * (j & 1))) & 15;
            if (t == T_Q5_K) v |= ((qh[l] >> j) & 1) << 4;
            q[32 * j + l] = (int8_t)v;
        }
    }
    return 32;
}

static void quantize_q8_c(const float *x, int n, q8blk *out) {
    for (int b = 0; b < n / QK; b++) {
        const float *xb = x + b * QK;
        float amax = 0.f;
        for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(xb[j]));
        float d = amax / 127.f, id = d > 0 ? 1.f / d : 0.f;
        int32_t s = 0;
        for (int j = 0; j < QK; j++) {
            int v = (int)lrintf(xb[j] * id);
            out[b].q[j] = (int8_t)v;
            s += v;
        }
        out[b].d = d;
        out[b].s = s;
    }
}

/* ---- dot products, portable ---------------------------------------------------------------- */

/* exact: w (n values in type t) . x (float) */
static INLINE float dot_exact_of(int t, const uint8_t *w, const float *x, int n) {
    float acc = 0.f;
    switch (t) {
    case T_F32: { const float *f = (const float *)w; for (int i = 0; i < n; i++) acc += f[i] * x[i]; break; }
    case T_F16: for (int i = 0; i < n; i++) acc += f16_to_f32(rd16(w + 2 * i)) * x[i]; break;
    case T_BF16: for (int i = 0; i < n; i++) acc += bf16_to_f32(rd16(w + 2 * i)) * x[i]; break;
    case T_Q4_0:
        for (int b = 0; b < n / QK; b++, w += 18, x += QK) {
            float s = 0.f;
            for (int j = 0; j < 16; j++) s += (float)((w[2 + j] & 15) - 8) * x[j] + (float)((w[2 + j] >> 4) - 8) * x[j + 16];
            acc += f16_to_f32(rd16(w)) * s;
        }
        break;
    case T_Q4_1:
        for (int b = 0; b < n / QK; b++, w += 20, x += QK) {
            float s = 0.f, sx = 0.f;
            for (int j = 0; j < 16; j++) {
                s += (float)(w[4 + j] & 15) * x[j] + (float)(w[4 + j] >> 4) * x[j + 16];
                sx += x[j] + x[j + 16];
            }
            acc += f16_to_f32(rd16(w)) * s + f16_to_f32(rd16(w + 2)) * sx;
        }
        break;
    case T_Q8_0:
        for (int b = 0; b < n / QK; b++, w += 34, x += QK) {
            float s = 0.f;
            for (int j = 0; j < QK; j++) s += (float)(int8_t)w[2 + j] * x[j];
            acc += f16_to_f32(rd16(w)) * s;
        }
        break;
    case T_Q5_0: case T_Q5_1: case T_IQ4_NL: case T_MXFP4: {
        int8_t q[QK];
        for (int b = 0; b < n / QK; b++, w += type_bytes(t), x += QK) {
            float s = 0.f, sx = 0.f;
            unpack32(t, w, q);
            for (int j = 0; j < QK; j++) { s += (float)q[j] * x[j]; sx += x[j]; }
            acc += q32_d(t, w) * s + (t == T_Q5_1 ? f16_to_f32(rd16(w + 2)) * sx : 0.f);
        }
        break;
    }
    case T_Q2_K: case T_Q3_K: case T_Q4_K: case T_Q5_K: case T_Q6_K: case T_IQ4_XS: case T_IQ3_XXS: case T_IQ3_S: {
        int8_t q[QKK];
        float scl[16], mn[16];
        for (int b = 0; b < n / QKK; b++, w += type_bytes(t), x += QKK) {
            int ss = kunpack(t, w, q, scl, mn);
            for (int j = 0; j < QKK / ss; j++) {  /* per sub-block: scale . (q . x) - min . sum(x) */
                float s = 0.f, sx = 0.f;
                for (int l = j * ss; l < (j + 1) * ss; l++) { s += (float)q[l] * x[l]; sx += x[l]; }
                acc += scl[j] * s - mn[j] * sx;
            }
        }
        break;
    }
    }
    return acc;
}

/* fast: w (quantized type) . xq (q8 blocks); float types fall back to the exact product with x */
static INLINE float dot_fast_of(int t, const uint8_t *w, const q8blk *xq, int nb) {
    float acc = 0.f;
    if (is_kquant(t)) {  /* a K block of 256 spans 8 q8 blocks */
        int8_t q[QKK];
        float scl[16], mn[16];
        for (int b = 0; b < nb / 8; b++, w += type_bytes(t)) {
            int ss = kunpack(t, w, q, scl, mn);
            for (int c = 0; c < 8; c++, xq++) {
                const int8_t *qc = q + QK * c;
                if (ss == QK) {  /* Q4_K, Q5_K: sub-block c is this q8 block; its min needs sum(qx) */
                    int32_t s = 0;
                    for (int l = 0; l < QK; l++) s += qc[l] * xq->q[l];
                    acc += scl[c] * xq->d * (float)s - mn[c] * xq->d * (float)xq->s;
                } else if (t == T_Q2_K) {  /* two sub-blocks of 16, each with its min: needs sum(qx) per 16 */
                    int32_t s0 = 0, s1 = 0, x0 = 0, x1 = 0;
                    for (int l = 0; l < 16; l++) {
                        s0 += qc[l] * xq->q[l], s1 += qc[16 + l] * xq->q[16 + l];
                        x0 += xq->q[l], x1 += xq->q[16 + l];
                    }
                    acc += xq->d * (scl[2 * c] * (float)s0 + scl[2 * c + 1] * (float)s1 - (mn[2 * c] * (float)x0 + mn[2 * c + 1] * (float)x1));
                } else {  /* Q6_K, Q3_K: two sub-blocks of 16, signed q, no min */
                    int32_t s0 = 0, s1 = 0;
                    for (int l = 0; l < 16; l++) { s0 += qc[l] * xq->q[l]; s1 += qc[16 + l] * xq->q[16 + l]; }
                    acc += xq->d * (scl[2 * c] * (float)s0 + scl[2 * c + 1] * (float)s1);
                }
            }
        }
        return acc;
    }
    for (int b = 0; b < nb; b++, xq++) {
        int32_t s = 0;
        switch (t) {
        case T_Q4_0:
            for (int j = 0; j < 16; j++) s += (w[2 + j] & 15) * xq->q[j] + (w[2 + j] >> 4) * xq->q[j + 16];
            acc += f16_to_f32(rd16(w)) * xq->d * (float)(s - 8 * xq->s);
            w += 18;
            break;
        case T_Q4_1:
            for (int j = 0; j < 16; j++) s += (w[4 + j] & 15) * xq->q[j] + (w[4 + j] >> 4) * xq->q[j + 16];
            acc += f16_to_f32(rd16(w)) * xq->d * (float)s + f16_to_f32(rd16(w + 2)) * xq->d * (float)xq->s;
            w += 20;
            break;
        case T_Q8_0:
            for (int j = 0; j < QK; j++) s += (int8_t)w[2 + j] * xq->q[j];
            acc += f16_to_f32(rd16(w)) * xq->d * (float)s;
            w += 34;
            break;
        case T_Q5_0: case T_Q5_1: case T_IQ4_NL: case T_MXFP4: {  /* Q5_1's min times sum(x) as Q4_1's */
            int8_t q[QK];
            unpack32(t, w, q);
            for (int j = 0; j < QK; j++) s += q[j] * xq->q[j];
            acc += q32_d(t, w) * xq->d * (float)s + (t == T_Q5_1 ? f16_to_f32(rd16(w + 2)) * xq->d * (float)xq->s : 0.f);
            w += type_bytes(t);
            break;
        }
        }
    }
    return acc;
}

/* y += a * w (n values in type t): the down projection of one active neuron when the file holds
 * down transposed (PowerInfer's ffn_down_t: a neuron's down column is a row of blocks) */
static INLINE void axpy_of(int t, const uint8_t *w, float a, float *y, int n) {
    switch (t) {
    case T_F32: { const float *f = (const float *)w; for (int i = 0; i < n; i++) y[i] += a * f[i]; break; }
    case T_F16: for (int i = 0; i < n; i++) y[i] += a * f16_to_f32(rd16(w + 2 * i)); break;
    case T_BF16: for (int i = 0; i < n; i++) y[i] += a * bf16_to_f32(rd16(w + 2 * i)); break;
    case T_Q4_0:
        for (int b = 0; b < n / QK; b++, w += 18, y += QK) {
            float ad = a * f16_to_f32(rd16(w));
            for (int j = 0; j < 16; j++) { y[j] += ad * (float)((w[2 + j] & 15) - 8); y[j + 16] += ad * (float)((w[2 + j] >> 4) - 8); }
        }
        break;
    case T_Q4_1:
        for (int b = 0; b < n / QK; b++, w += 20, y += QK) {
            float ad = a * f16_to_f32(rd16(w)), am = a * f16_to_f32(rd16(w + 2));
            for (int j = 0; j < 16; j++) { y[j] += ad * (float)(w[4 + j] & 15) + am; y[j + 16] += ad * (float)(w[4 + j] >> 4) + am; }
        }
        break;
    case T_Q8_0:
        for (int b = 0; b < n / QK; b++, w += 34, y += QK) {
            float ad = a * f16_to_f32(rd16(w));
            for (int j = 0; j < QK; j++) y[j] += ad * (float)(int8_t)w[2 + j];
        }
        break;
    case T_Q5_0: case T_Q5_1: case T_IQ4_NL: case T_MXFP4: {
        int8_t q[QK];
        for (int b = 0; b < n / QK; b++, w += type_bytes(t), y += QK) {
            float ad = a * q32_d(t, w), am = t == T_Q5_1 ? a * f16_to_f32(rd16(w + 2)) : 0.f;
            unpack32(t, w, q);
            for (int j = 0; j < QK; j++) y[j] += ad * (float)q[j] + am;
        }
        break;
    }
    case T_Q2_K: case T_Q3_K: case T_Q4_K: case T_Q5_K: case T_Q6_K: case T_IQ4_XS: case T_IQ3_XXS: case T_IQ3_S: {
        int8_t q[QKK];
        float scl[16], mn[16];
        for (int b = 0; b < n / QKK; b++, w += type_bytes(t), y += QKK) {
            int ss = kunpack(t, w, q, scl, mn);
            for (int l = 0; l < QKK; l++) y[l] += a * scl[l / ss] * (float)q[l] - a * mn[l / ss];
        }
        break;
    }
    }
}


/* The portable kernels with the type as an argument: what the generic level's table entries
 * call, and the SIMD levels' fallbacks for types they have no kernel of. Out of line, one switch
 * a row: before the table they were inlined into the row loops, which a table's pointer cannot
 * be. Specialized per type instead (the *_of bodies with the type a constant, as the SIMD
 * entries are), the generic level's times moved both ways with GCC's vectorizing (one core,
 * the 1.1B shape, against the build before the table: Q4_0 7-13 % slower, Q5_0 and Q6_K 20 %
 * faster); out of line, the same as before within 2 % but Q5_0, 5 % slower. */
#define NOINLINE __attribute__((noinline))
NOINLINE static float dot_exact_c(int t, const uint8_t *w, const float *x, int n) { return dot_exact_of(t, w, x, n); }
NOINLINE static float dot_fast_c(int t, const uint8_t *w, const q8blk *xq, int nb) { return dot_fast_of(t, w, xq, nb); }
NOINLINE static void axpy_c(int t, const uint8_t *w, float a, float *y, int n) { axpy_of(t, w, a, y, n); }

/* One row's n values at w (type t, whole blocks) as float32 into o */
static void dequant_row(int t, const uint8_t *w, int n, float *o) {
    switch (t) {
    case T_F32: memcpy(o, w, sizeof(float) * n); break;
    case T_F16: for (int j = 0; j < n; j++) o[j] = f16_to_f32(rd16(w + 2 * j)); break;
    case T_BF16: for (int j = 0; j < n; j++) o[j] = bf16_to_f32(rd16(w + 2 * j)); break;
    case T_Q4_0:
        for (int b = 0; b < n / QK; b++, w += 18, o += QK) {
            float d = f16_to_f32(rd16(w));
            for (int j = 0; j < 16; j++) { o[j] = d * (float)((w[2 + j] & 15) - 8); o[j + 16] = d * (float)((w[2 + j] >> 4) - 8); }
        }
        break;
    case T_Q4_1:
        for (int b = 0; b < n / QK; b++, w += 20, o += QK) {
            float d = f16_to_f32(rd16(w)), mn = f16_to_f32(rd16(w + 2));
            for (int j = 0; j < 16; j++) { o[j] = d * (float)(w[4 + j] & 15) + mn; o[j + 16] = d * (float)(w[4 + j] >> 4) + mn; }
        }
        break;
    case T_Q8_0:
        for (int b = 0; b < n / QK; b++, w += 34, o += QK) {
            float d = f16_to_f32(rd16(w));
            for (int j = 0; j < QK; j++) o[j] = d * (float)(int8_t)w[2 + j];
        }
        break;
    case T_Q5_0: case T_Q5_1: case T_IQ4_NL: case T_MXFP4: {  /* as gguf-py: d q (+ m) */
        int8_t q[QK];
        for (int b = 0; b < n / QK; b++, w += type_bytes(t), o += QK) {
            float d = q32_d(t, w);
            unpack32(t, w, q);
            if (t == T_Q5_1) {
                float mn = f16_to_f32(rd16(w + 2));
                for (int j = 0; j < QK; j++) o[j] = d * (float)q[j] + mn;
            } else
                for (int j = 0; j < QK; j++) o[j] = d * (float)q[j];
        }
        break;
    }
    case T_Q2_K: case T_Q3_K: case T_Q4_K: case T_Q5_K: case T_Q6_K: case T_IQ4_XS: case T_IQ3_XXS: case T_IQ3_S: {
        int8_t q[QKK];
        float scl[16], mn[16];
        for (int b = 0; b < n / QKK; b++, w += type_bytes(t), o += QKK) {
            int ss = kunpack(t, w, q, scl, mn);
            for (int l = 0; l < QKK; l++) o[l] = scl[l / ss] * (float)q[l] - mn[l / ss];  /* as gguf-py: (d sc) q - dmin m */
        }
        break;
    }
    }
}
