/* The interleaved layout of the 256-weight types (Q4_K, Q5_K, Q6_K, IQ4_XS), for gguf_interleaved.c, which
 * includes this file (their products are in gguf_interleaved_kernels.c).
 *
 * As for the 32-weight types, rows are interleaved in groups of 16 and a 64-byte vector holds the same 4 weights
 * ("quad") of the 16 rows; per 256-weight block of a group, 16 blocks' bytes (the file's size), each field of
 * the file's block moved, not changed (`k_offset` says where file byte o of row l goes):
 *   Q4_K:   d[16] | dmin[16] | the packed scales as 3 vectors (words 0-3, 4-7, 8-11 of each row's 12 bytes) |
 *           qs: per 32-byte chunk c and quad v, [row l: qs[32c + 4v .. +3]] (low nibbles sub-block 2c, high 2c+1)
 *   Q5_K:   as Q4_K, with qh per quad v, [row l: qh[4v .. +3]] (bit j: sub-block j's fifth bit), before qs
 *   Q6_K:   d[16] | scales as 4 vectors (words of 4 int8) | ql per half h, 32-byte run k and quad v |
 *           qh per half h and quad v
 *   IQ4_XS: d[16] | scales_h[16] | scales_l as a vector of words | qs per sub-block j and quad c, as IQ4_NL's
 * A block's products: per sub-block (32 weights; Q6_K: two sub-blocks of 16) an int32 sum per row from 8
 * vpdpbusd, times the row's integer sub-block scale (vpmulld), summed over the block in int32, then scaled by
 * d * d_x once; Q4_K's and Q5_K's minimums subtract dmin * d_x * sum_j m_j * sum(x over sub-block j), the sum
 * over the block's 8 sub-blocks taken once per block by 4 vpdpwssd on int16 pairs of minimums and activation
 * sums (no per-sub-block multiply), and Q6_K's centre 32 and IQ4_XS's 128 (its grid values are kept unsigned,
 * plus 128) are subtracted in the integer sums. Activations are rounded per 256, as for the row kernel.
 */

/* Where file byte o (0 .. block bytes - 1) of lane l's block goes within a group's block (16 blocks' bytes). */
static inline int64_t k_offset(int type, int l, int o) {
    switch (type) {
    case KV_Q6_K:
        if (o >= 208) return 2 * l + (o - 208);                                   /* d */
        if (o >= 192) return 32 + 64 * ((o - 192) / 4) + 4 * l + (o - 192) % 4; /* scales */
        if (o >= 128) {                                                          /* qh: half, quad */
            int q = o - 128;
            return 288 + 2048 + 64 * (8 * (q / 32) + (q % 32) / 4) + 4 * l + q % 4;
        }
        return 288 + 64 * (16 * (o / 64) + 8 * ((o % 64) / 32) + (o % 32) / 4) + 4 * l + o % 4; /* ql */
    case KV_IQ4_XS:
        if (o < 2) return 2 * l + o;
        if (o < 4) return 32 + 2 * l + (o - 2);
        if (o < 8) return 64 + 4 * l + (o - 4);
        return 128 + 64 * (4 * ((o - 8) / 16) + ((o - 8) % 16) / 4) + 4 * l + (o - 8) % 4;
    default: { /* Q4_K, Q5_K */
        if (o < 2) return 2 * l + o;
        if (o < 4) return 32 + 2 * l + (o - 2);
        if (o < 16) return 64 + 64 * ((o - 4) / 4) + 4 * l + (o - 4) % 4;
        int qs_start = 256, q = o - 16;
        if (type == KV_Q5_K) {
            if (q < 32) return 256 + 64 * (q / 4) + 4 * l + q % 4; /* qh */
            qs_start = 256 + 512, q -= 32;
        }
        return qs_start + 64 * (8 * (q / 32) + (q % 32) / 4) + 4 * l + q % 4;
    }
    }
}

/* Rows of file-layout 256-weight blocks -> the interleaved layout (missing rows of the last group zero). */
static void interleave_k(int type, const uint8_t *src, uint8_t *dst, int64_t rows, int64_t K, int num_threads) {
    const int64_t nb = K / QK_K, block_bytes = bytes_per_k_block(type), stride = GROUP_ROWS * block_bytes;
    const int64_t groups = (rows + GROUP_ROWS - 1) / GROUP_ROWS;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *out = dst + (g * nb + b) * stride;
            __builtin_memset(out, 0, (size_t)stride);
            for (int l = 0; l < GROUP_ROWS && g * GROUP_ROWS + l < rows; l++) {
                const uint8_t *block = src + ((g * GROUP_ROWS + l) * nb + b) * block_bytes;
                for (int o = 0; o < block_bytes; o++) out[k_offset(type, l, o)] = block[o];
            }
        }
    }
}

/* Row n of interleaved 256-weight blocks -> K float32 weights: each block gathered back into the file's layout
 * and decoded by dequantize_row_k, so the numbers are the file layout's bit for bit. */
static void dequantize_interleaved_k_row(int type, const uint8_t *w, int64_t K, int64_t n, float *dst) {
    const int64_t nb = K / QK_K, block_bytes = bytes_per_k_block(type), stride = GROUP_ROWS * block_bytes;
    const uint8_t *group = w + (n / GROUP_ROWS) * nb * stride;
    const int l = (int)(n % GROUP_ROWS);
    uint8_t block[sizeof(BlockQ6_K)]; /* the largest of the four */
    for (int64_t b = 0; b < nb; b++) {
        for (int o = 0; o < block_bytes; o++) block[o] = group[b * stride + k_offset(type, l, o)];
        dequantize_row_k(type, block, QK_K, dst + b * QK_K);
    }
}
