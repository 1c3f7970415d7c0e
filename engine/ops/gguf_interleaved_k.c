/* The interleaved layout and register-tiled products of the 256-weight types (Q4_K, Q5_K, Q6_K, IQ4_XS), for
 * gguf_interleaved.c, which includes this file.
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
 * d * d_x once; Q4_K's and Q5_K's minimums add dmin * m_j * sum(x over sub-block j) the same way, and Q6_K's
 * centre 32 and IQ4_XS's 128 (its grid values are kept unsigned, plus 128) are subtracted in the integer
 * sums. Activations are rounded per 256, as for the row kernel.
 */

#define K_TILE_MAX_R 4 /* activation rows per pass: two int32 sums and a float sum each stay in registers */

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

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni")

/* Activation rows rounded per 256 values: q int8 [M*K]; d per 256; sum16 and sum32, the integer sums of each
 * 16 and 32 values. */
typedef struct {
    int8_t *q;
    float *d;
    int32_t *sum16, *sum32;
} KActivations;

/* Sub-block j's 32 weights (8 quads) of the group's block at p, unsigned; *scale: each row's integer scale of
 * the sub-block, *second the second 16's (Q6_K), *minimum its minimum (Q4_K, Q5_K). */
static inline __attribute__((always_inline)) void unpack_k_sub_block(int type, const uint8_t *p, int j,
                                                                     __m512i w[8], __m512i *scale, __m512i *second,
                                                                     __m512i *minimum) {
    const __m512i low4 = _mm512_set1_epi8(0x0F), byte = _mm512_set1_epi32(0xFF);
    if (type == KV_Q6_K) {
        const int h = j / 4, g = j % 4;
        const uint8_t *ql = p + 288 + 64 * (16 * h + 8 * (g % 2)), *qh = p + 288 + 2048 + 64 * 8 * h;
        const __m512i top2 = _mm512_set1_epi8(0x30);
        for (int v = 0; v < 8; v++) {
            __m512i lo = _mm512_loadu_si512(ql + 64 * v), hi = _mm512_loadu_si512(qh + 64 * v);
            lo = g < 2 ? _mm512_and_si512(lo, low4) : _mm512_and_si512(_mm512_srli_epi16(lo, 4), low4);
            hi = g < 3 ? _mm512_slli_epi16(hi, 4 - 2 * g) : _mm512_srli_epi16(hi, 2);
            w[v] = _mm512_or_si512(lo, _mm512_and_si512(hi, top2));
        }
        /* sub-blocks 2j and 2j + 1: bytes (2j) % 4 and (2j + 1) % 4 of scale word (2j) / 4, sign-extended */
        __m512i words = _mm512_loadu_si512(p + 32 + 64 * (j / 2));
        const int first = (2 * j) % 4;
        *scale = _mm512_srai_epi32(_mm512_slli_epi32(words, 24 - 8 * first), 24);
        *second = _mm512_srai_epi32(_mm512_slli_epi32(words, 16 - 8 * first), 24);
        return;
    }
    if (type == KV_IQ4_XS) {
        const __m512i grid = _mm512_broadcast_i32x4(
            _mm_xor_si128(_mm_loadu_si128((const __m128i *)IQ4_VALUES), _mm_set1_epi8((char)0x80)));
        for (int c = 0; c < 4; c++) {
            __m512i raw = _mm512_loadu_si512(p + 128 + 64 * (4 * j + c));
            w[c] = _mm512_shuffle_epi8(grid, _mm512_and_si512(raw, low4));
            w[c + 4] = _mm512_shuffle_epi8(grid, _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4));
        }
        /* the low 4 bits from nibble j of the scales_l word, the top 2 from bits 2j, 2j + 1 of scales_h */
        __m512i low = _mm512_and_si512(_mm512_srli_epi32(_mm512_loadu_si512(p + 64), 4 * j), _mm512_set1_epi32(0x0F));
        __m512i high = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p + 32)));
        high = _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(high, 2 * j), _mm512_set1_epi32(3)), 4);
        *scale = _mm512_sub_epi32(_mm512_or_si512(low, high), _mm512_set1_epi32(32));
        return;
    }
    /* Q4_K, Q5_K: the packed scales' three words per row, decoded as k_scales_and_mins_vector does */
    const __m512i a = _mm512_loadu_si512(p + 64), b = _mm512_loadu_si512(p + 128), c = _mm512_loadu_si512(p + 192);
    const __m512i six = _mm512_set1_epi8(0x3F), two = _mm512_set1_epi8(0x03);
    __m512i scales, minimums;
    if (j < 4) {
        scales = _mm512_and_si512(a, six);
        minimums = _mm512_and_si512(b, six);
    } else {
        scales = _mm512_or_si512(_mm512_and_si512(c, low4),
                                 _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(a, 6), two), 4));
        minimums = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(c, 4), low4),
                                   _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(b, 6), two), 4));
    }
    *scale = _mm512_and_si512(_mm512_srli_epi32(scales, 8 * (j % 4)), byte);
    *minimum = _mm512_and_si512(_mm512_srli_epi32(minimums, 8 * (j % 4)), byte);
    const int five_bit = type == KV_Q5_K;
    const uint8_t *qs = p + (five_bit ? 768 : 256) + 64 * 8 * (j / 2);
    for (int v = 0; v < 8; v++) {
        __m512i raw = _mm512_loadu_si512(qs + 64 * v);
        w[v] = j % 2 ? _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4) : _mm512_and_si512(raw, low4);
        if (five_bit) { /* bit j of the quad's qh bytes, moved to bit 4 */
            __m512i qh = _mm512_loadu_si512(p + 256 + 64 * v);
            qh = j <= 4 ? _mm512_slli_epi16(qh, 4 - j) : _mm512_srli_epi16(qh, j - 4);
            w[v] = _mm512_or_si512(w[v], _mm512_and_si512(qh, _mm512_set1_epi8(0x10)));
        }
    }
}

/* y[m0 .. m0+R, n0 .. n0+16] for one group of 16 rows of 256-weight blocks (nb blocks from w). */
static inline __attribute__((always_inline)) void interleaved_k_dot(int type, const uint8_t *w, int64_t nb,
                                                                    const KActivations *act, int64_t m0, const int R,
                                                                    const float *bias, float *y, int64_t N,
                                                                    int64_t n0) {
    __m512 acc[K_TILE_MAX_R];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    const int64_t stride = GROUP_ROWS * bytes_per_k_block(type);
    const int has_min = type == KV_Q4_K || type == KV_Q5_K;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = w + b * stride;
        for (int64_t ahead = 0; ahead < stride; ahead += 512) __builtin_prefetch(p + PREFETCH_BYTES + ahead);
        __m512i sums[K_TILE_MAX_R], mins[K_TILE_MAX_R];
        for (int r = 0; r < R; r++) sums[r] = mins[r] = _mm512_setzero_si512();
        for (int j = 0; j < 8; j++) {
            __m512i q[8], scale, second = _mm512_setzero_si512(), minimum = _mm512_setzero_si512();
            unpack_k_sub_block(type, p, j, q, &scale, &second, &minimum);
            for (int r = 0; r < R; r++) {
                const int64_t i = (m0 + r) * nb + b;
                const int32_t *quads = (const int32_t *)(act->q + i * QK_K + 32 * j);
                if (type == KV_Q6_K) { /* two sub-blocks of 16, each centred at 32 */
                    __m512i s0 = _mm512_set1_epi32(-32 * act->sum16[i * 16 + 2 * j]);
                    __m512i s1 = _mm512_set1_epi32(-32 * act->sum16[i * 16 + 2 * j + 1]);
                    for (int v = 0; v < 4; v++) {
                        s0 = _mm512_dpbusd_epi32(s0, q[v], _mm512_set1_epi32(quads[v]));
                        s1 = _mm512_dpbusd_epi32(s1, q[v + 4], _mm512_set1_epi32(quads[v + 4]));
                    }
                    sums[r] = _mm512_add_epi32(sums[r], _mm512_add_epi32(_mm512_mullo_epi32(s0, scale),
                                                                         _mm512_mullo_epi32(s1, second)));
                    continue;
                }
                const int32_t start = type == KV_IQ4_XS ? -128 * act->sum32[i * 8 + j] : 0;
                __m512i s = _mm512_set1_epi32(start);
                for (int v = 0; v < 8; v++) s = _mm512_dpbusd_epi32(s, q[v], _mm512_set1_epi32(quads[v]));
                sums[r] = _mm512_add_epi32(sums[r], _mm512_mullo_epi32(s, scale));
                if (has_min)
                    mins[r] = _mm512_add_epi32(mins[r],
                                               _mm512_mullo_epi32(minimum, _mm512_set1_epi32(act->sum32[i * 8 + j])));
            }
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
        const __m512 dmin = has_min ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 32))) : d;
        for (int r = 0; r < R; r++) {
            const __m512 dx = _mm512_set1_ps(act->d[(m0 + r) * nb + b]);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r]), _mm512_mul_ps(d, dx), acc[r]);
            if (has_min) acc[r] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(mins[r]), _mm512_mul_ps(dmin, dx), acc[r]);
        }
    }
    const __mmask16 valid = N - n0 >= GROUP_ROWS ? (__mmask16)0xFFFF : (__mmask16)((1u << (N - n0)) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(valid, bias + n0) : _mm512_setzero_ps();
    for (int r = 0; r < R; r++) _mm512_mask_storeu_ps(y + (m0 + r) * N + n0, valid, _mm512_add_ps(acc[r], b));
}

static inline __attribute__((always_inline)) void interleaved_k_gemm_type(int type, const uint8_t *w, int64_t M,
                                                                          int64_t nb, const KActivations *act,
                                                                          const float *bias, float *y, int64_t N,
                                                                          int num_threads) {
    const int64_t groups = (N + GROUP_ROWS - 1) / GROUP_ROWS, group_bytes = nb * GROUP_ROWS * bytes_per_k_block(type);
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *group = w + g * group_bytes;
        for (int64_t m0 = 0; m0 < M; m0 += K_TILE_MAX_R) {
            const int R = (int)(M - m0 < K_TILE_MAX_R ? M - m0 : K_TILE_MAX_R);
            switch (R) {
            case 4: interleaved_k_dot(type, group, nb, act, m0, 4, bias, y, N, g * GROUP_ROWS); break;
            case 3: interleaved_k_dot(type, group, nb, act, m0, 3, bias, y, N, g * GROUP_ROWS); break;
            case 2: interleaved_k_dot(type, group, nb, act, m0, 2, bias, y, N, g * GROUP_ROWS); break;
            default: interleaved_k_dot(type, group, nb, act, m0, 1, bias, y, N, g * GROUP_ROWS); break;
            }
        }
    }
}

/* y [M, N] = x [M, K] times interleaved 256-weight blocks of `type` (+ bias). Returns 0, or 1 when out of
 * memory. */
static int interleaved_k_gemm(const float *x, int64_t M, int64_t K, int type, const uint8_t *w, const float *bias,
                              float *y, int64_t N, int num_threads) {
    const int64_t nb = K / QK_K;
    const size_t q_bytes = ((size_t)(M * K) + 63) & ~(size_t)63, d_bytes = ((size_t)(M * nb) * 4 + 63) & ~(size_t)63;
    const size_t sums_bytes = ((size_t)(M * K / 16) * 4 + 63) & ~(size_t)63;
    uint8_t *buffer = aligned_alloc(64, q_bytes + d_bytes + 2 * sums_bytes);
    if (!buffer) return 1;
    KActivations act = {(int8_t *)buffer, (float *)(buffer + q_bytes), (int32_t *)(buffer + q_bytes + d_bytes),
                        (int32_t *)(buffer + q_bytes + d_bytes + sums_bytes)};
#pragma omp parallel for num_threads(num_threads) schedule(static) if (M > 1)
    for (int64_t m = 0; m < M; m++) {
        for (int64_t b = 0; b < nb; b++) {
            const int64_t i = m * nb + b;
            int8_t *q = act.q + i * QK_K;
            int sum;
            act.d[i] = round_block(x + m * K + b * QK_K, QK_K, q, &sum);
            for (int g = 0; g < 16; g++) {
                int total = 0;
                for (int k = 16 * g; k < 16 * g + 16; k++) total += q[k];
                act.sum16[i * 16 + g] = total;
            }
            for (int j = 0; j < 8; j++) act.sum32[i * 8 + j] = act.sum16[i * 16 + 2 * j] + act.sum16[i * 16 + 2 * j + 1];
        }
    }
    switch (type) {
    case KV_Q4_K: interleaved_k_gemm_type(KV_Q4_K, w, M, nb, &act, bias, y, N, num_threads); break;
    case KV_Q5_K: interleaved_k_gemm_type(KV_Q5_K, w, M, nb, &act, bias, y, N, num_threads); break;
    case KV_Q6_K: interleaved_k_gemm_type(KV_Q6_K, w, M, nb, &act, bias, y, N, num_threads); break;
    default: interleaved_k_gemm_type(KV_IQ4_XS, w, M, nb, &act, bias, y, N, num_threads); break;
    }
    free(buffer);
    return 0;
}

#pragma GCC pop_options
