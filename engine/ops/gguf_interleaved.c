/* Register-tiled products over 32-weight GGUF blocks interleaved by rows, on AVX-512 VNNI CPUs, for
 * gguf_blocks.c, which includes this file. Compiled into every build (the functions carry their own target) and
 * called only for weights interleaved by kv_gguf_interleave, which the Python side does only where the CPU has
 * AVX-512 F/BW/VL and VNNI.
 *
 * Why: the row kernel (dot_row) multiplies one weight row at a time, so every 32 products pay for a scale
 * broadcast, a conversion and a horizontal sum, and batched decode and prefill ran at the 1-row rate per
 * row. Here a 512-bit register holds the same 4 weights of 16 weight rows, so one vpdpbusd with one 4-byte
 * activation quad broadcast adds 64 products into 16 output columns, and a block's scales are a vector of
 * the 16 rows' fp16 scales. Unpacking a block (nibbles to bytes) is paid once per tile of up to TILE_MAX_R
 * activation rows.
 *
 * The interleaved layout (type | KV_INTERLEAVED): rows in groups of 16 (the last group padded with zero rows); per
 * group, its blocks in order; per block of the group, 16 blocks' worth of bytes (the file's size):
 *   d[16]   fp16 scales, row l's in lane l;
 *   m[16]   fp16 offsets (Q4_1, Q5_1 only);
 *   qh[64]  fifth bits (Q5_0, Q5_1): bit v of byte 4l + j is the fifth bit of row l's weight 4v + j;
 *   qs      4-bit types and IQ4_NL: 4 chunks of 64 bytes; bytes 4l..4l+3 of chunk c are row l's file bytes
 *           qs[4c..4c+3], so their low nibbles are weights 4c..4c+3 ("quad" c) and their high nibbles weights
 *           16 + 4c.. (quad c + 4): the file's nibbles, moved but not changed;
 *           Q8_0: 8 chunks of 64 bytes, chunk v lane l row l's weights 4v..4v+3, each plus 128 (unsigned).
 * So for each quad v (weights 4v..4v+3) one 64-byte vector holds every row's 4 weights as unsigned bytes
 * (4-bit 0..15, 5-bit 0..31, Q8_0 and IQ4_NL's grid values plus 128), vpdpbusd's unsigned operand; the
 * activations are the signed one. The weights' centre (Q4_0's 8, Q5_0's 16, the 128 added above) is
 * subtracted exactly in the integer sums, which start at -centre * sum(x) of the activation block.
 *
 * Each (row, column) pair is summed block by block in the same order whatever M is and however rows are
 * tiled, so a row's result does not depend on its batch.
 */

enum { KV_INTERLEAVED = 0x200 };

#define GROUP_ROWS 16 /* weight rows per group: one 512-bit register of int32 sums */
#define TILE_MAX_R 8 /* activation rows multiplied per pass over a group's unpacked blocks */

/* The types with an interleaved layout: the 32-weight ones here, the 256-weight ones in gguf_interleaved_k.c. */
static inline int is_interleavable(int base) {
    return base == KV_Q4_0 || base == KV_Q4_1 || base == KV_Q5_0 || base == KV_Q5_1 || base == KV_Q8_0 ||
           base == KV_IQ4_NL || is_k_type(base);
}

static inline int interleaved_has_offset(int base) { return base == KV_Q4_1 || base == KV_Q5_1; }
static inline int interleaved_is_5bit(int base) { return base == KV_Q5_0 || base == KV_Q5_1; }

/* What the unsigned weight bytes hold beyond the weight's integer value, subtracted from the sums. */
static inline int interleaved_centre(int base) {
    switch (base) {
    case KV_Q4_0: return 8;
    case KV_Q5_0: return 16;
    case KV_Q8_0:
    case KV_IQ4_NL: return 128;
    default: return 0;
    }
}

/* Bytes of one block of a group (16 rows' blocks). */
static inline int64_t interleaved_block_bytes(int base) { return GROUP_ROWS * bytes_per_block(base); }

/* Row n's weight k (0..31) of an interleaved block: its integer value before the centre is subtracted (IQ4_NL: the
 * grid index). */
static inline int interleaved_weight(int base, const uint8_t *qh, const uint8_t *qs, int lane, int k) {
    int v = k / 4, j = k % 4;
    if (base == KV_Q8_0) return (int)(int8_t)(qs[64 * v + 4 * lane + j] ^ 0x80);
    uint8_t byte = qs[64 * (v % 4) + 4 * lane + j];
    int q = v < 4 ? byte & 0x0F : byte >> 4;
    if (qh) q |= ((qh[4 * lane + j] >> v) & 1) << 4;
    return q;
}

#include "gguf_interleaved_k.c"

/* Row n (0-based over the whole weight) of interleaved blocks -> K float32 weights, rounded as dequantize_row
 * rounds the file's layout. */
static void dequantize_interleaved_row(int base, const uint8_t *w, int64_t K, int64_t n, float *dst) {
    if (is_k_type(base)) {
        dequantize_interleaved_k_row(base, w, K, n, dst);
        return;
    }
    const int64_t nb = K / QK, stride = interleaved_block_bytes(base);
    const uint8_t *group = w + (n / GROUP_ROWS) * nb * stride;
    const int lane = (int)(n % GROUP_ROWS);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = group + b * stride;
        float d = fp16_to_float(((const uint16_t *)p)[lane]);
        p += 2 * GROUP_ROWS;
        float m = 0.0f;
        if (interleaved_has_offset(base)) {
            m = fp16_to_float(((const uint16_t *)p)[lane]);
            p += 2 * GROUP_ROWS;
        } else if (base == KV_Q4_0 || base == KV_Q5_0) {
            m = -(float)interleaved_centre(base) * d;
        }
        const uint8_t *qh = NULL;
        if (interleaved_is_5bit(base)) {
            qh = p;
            p += 64;
        }
        for (int k = 0; k < QK; k++) {
            int q = interleaved_weight(base, qh, p, lane, k);
            if (base == KV_Q8_0)
                dst[b * QK + k] = (float)q * d;
            else if (base == KV_IQ4_NL)
                dst[b * QK + k] = (float)IQ4_VALUES[q] * d;
            else
                dst[b * QK + k] = (float)q * d + m;
        }
    }
}

/* Rows of file-layout blocks of an interleavable type -> the interleaved layout; the last group's missing rows are zero
 * (scale 0). dst holds ceil(rows / 16) * 16 rows' bytes. Returns 2 for a type with no interleaved layout. */
int kv_gguf_interleave(int type, const uint8_t *src, uint8_t *dst, int64_t rows, int64_t K, int num_threads) {
    if (!is_interleavable(type) || K % weights_per_block(type) != 0) return 2;
    if (is_k_type(type)) {
        interleave_k(type, src, dst, rows, K, num_threads);
        return 0;
    }
    const int64_t nb = K / QK, block_bytes = bytes_per_block(type), row_bytes = nb * block_bytes;
    const int64_t groups = (rows + GROUP_ROWS - 1) / GROUP_ROWS, stride = interleaved_block_bytes(type);
    const int offset = interleaved_has_offset(type), five_bit = interleaved_is_5bit(type);
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *out = dst + (g * nb + b) * stride;
            __builtin_memset(out, 0, (size_t)stride);
            uint16_t *d = (uint16_t *)out, *m = (uint16_t *)(out + 2 * GROUP_ROWS);
            uint8_t *qh = out + 2 * GROUP_ROWS * (1 + offset), *qs = qh + (five_bit ? 64 : 0);
            for (int lane = 0; lane < GROUP_ROWS && g * GROUP_ROWS + lane < rows; lane++) {
                const uint8_t *block = src + (g * GROUP_ROWS + lane) * row_bytes + b * block_bytes;
                __builtin_memcpy(&d[lane], block, 2);
                if (offset) __builtin_memcpy(&m[lane], block + 2, 2);
                if (type == KV_Q8_0) {
                    for (int k = 0; k < QK; k++) qs[64 * (k / 4) + 4 * lane + k % 4] = (uint8_t)(block[2 + k] ^ 0x80);
                    continue;
                }
                const uint8_t *file_qs = block + block_bytes - 16;
                for (int i = 0; i < 16; i++) qs[64 * (i / 4) + 4 * lane + i % 4] = file_qs[i];
                if (five_bit) {
                    uint32_t high;
                    __builtin_memcpy(&high, file_qs - 4, 4);
                    for (int k = 0; k < QK; k++)
                        qh[4 * lane + k % 4] |= (uint8_t)(((high >> k) & 1) << (k / 4));
                }
            }
        }
    }
    return 0;
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni")

/* 1 when this CPU runs the interleaved kernels. */
int kv_gguf_interleaved_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}

/* Activation rows rounded to blocks of 32 for the interleaved products: q int8 [M*K], and per block d (scale),
 * s (d * sum q: the offset types' term) and start (-centre * sum q: where the integer sums begin). */
typedef struct {
    int8_t *q;
    float *d, *s;
    int32_t *start;
} InterleavedActivations;

/* One block of the group: the 8 quads' weight bytes of the 16 rows, their scales and offsets. */
typedef struct {
    __m512i w[8];
    __m512 d, m;
} InterleavedBlock;

static inline __attribute__((always_inline)) void unpack_interleaved(int base, const uint8_t *p, InterleavedBlock *t) {
    t->d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
    p += 2 * GROUP_ROWS;
    if (interleaved_has_offset(base)) {
        t->m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
        p += 2 * GROUP_ROWS;
    }
    if (base == KV_Q8_0) {
        for (int v = 0; v < 8; v++) t->w[v] = _mm512_loadu_si512(p + 64 * v);
        return;
    }
    __m512i high = _mm512_setzero_si512();
    if (interleaved_is_5bit(base)) {
        high = _mm512_loadu_si512(p);
        p += 64;
    }
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    for (int c = 0; c < 4; c++) {
        __m512i raw = _mm512_loadu_si512(p + 64 * c);
        t->w[c] = _mm512_and_si512(raw, low4);
        t->w[c + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
    }
    if (base == KV_IQ4_NL) { /* indices -> grid values + 128, one byte shuffle per quad */
        const __m512i grid = _mm512_broadcast_i32x4(
            _mm_xor_si128(_mm_loadu_si128((const __m128i *)IQ4_VALUES), _mm_set1_epi8((char)0x80)));
        for (int v = 0; v < 8; v++) t->w[v] = _mm512_shuffle_epi8(grid, t->w[v]);
    } else if (interleaved_is_5bit(base)) { /* quad v's fifth bits: bit v of each qh byte, moved to bit 4 */
        const __m512i bit4 = _mm512_set1_epi8(0x10);
        for (int v = 0; v < 8; v++) {
            __m512i moved = v <= 4 ? _mm512_slli_epi16(high, 4 - v) : _mm512_srli_epi16(high, v - 4);
            t->w[v] = _mm512_or_si512(t->w[v], _mm512_and_si512(moved, bit4));
        }
    }
}

/* y[m0 .. m0+R, n0 .. n0+16] for one group of 16 weight rows (nb blocks from w) and R activation rows. */
static inline __attribute__((always_inline)) void interleaved_dot(int base, const uint8_t *w, int64_t nb,
                                                            const InterleavedActivations *act, int64_t m0, const int R,
                                                            const float *bias, float *y, int64_t N, int64_t n0) {
    __m512 acc[TILE_MAX_R];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    const int64_t stride = interleaved_block_bytes(base);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = w + b * stride;
        __builtin_prefetch(p + PREFETCH_BYTES);
        __builtin_prefetch(p + PREFETCH_BYTES + 256);
        InterleavedBlock t;
        unpack_interleaved(base, p, &t);
        for (int r = 0; r < R; r++) {
            const int64_t i = (m0 + r) * nb + b;
            const int32_t *quads = (const int32_t *)(act->q + i * QK);
            __m512i sums = _mm512_set1_epi32(act->start[i]);
            for (int v = 0; v < 8; v++) sums = _mm512_dpbusd_epi32(sums, t.w[v], _mm512_set1_epi32(quads[v]));
            __m512 scale = _mm512_mul_ps(t.d, _mm512_set1_ps(act->d[i]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), scale, acc[r]);
            if (interleaved_has_offset(base)) acc[r] = _mm512_fmadd_ps(t.m, _mm512_set1_ps(act->s[i]), acc[r]);
        }
    }
    const __mmask16 valid = N - n0 >= GROUP_ROWS ? (__mmask16)0xFFFF : (__mmask16)((1u << (N - n0)) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(valid, bias + n0) : _mm512_setzero_ps();
    for (int r = 0; r < R; r++) _mm512_mask_storeu_ps(y + (m0 + r) * N + n0, valid, _mm512_add_ps(acc[r], b));
}

/* The interleaved pass for one base type (a constant at each call, so each type's loops compile on their own). */
static inline __attribute__((always_inline)) void interleaved_gemm_type(int base, const uint8_t *w, int64_t M, int64_t nb,
                                                                  const InterleavedActivations *act, const float *bias,
                                                                  float *y, int64_t N, int num_threads) {
    const int64_t groups = (N + GROUP_ROWS - 1) / GROUP_ROWS, group_bytes = nb * interleaved_block_bytes(base);
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *group = w + g * group_bytes;
        for (int64_t m0 = 0; m0 < M; m0 += TILE_MAX_R) {
            const int R = (int)(M - m0 < TILE_MAX_R ? M - m0 : TILE_MAX_R);
            switch (R) {
            case 8: interleaved_dot(base, group, nb, act, m0, 8, bias, y, N, g * GROUP_ROWS); break;
            case 7: interleaved_dot(base, group, nb, act, m0, 7, bias, y, N, g * GROUP_ROWS); break;
            case 6: interleaved_dot(base, group, nb, act, m0, 6, bias, y, N, g * GROUP_ROWS); break;
            case 5: interleaved_dot(base, group, nb, act, m0, 5, bias, y, N, g * GROUP_ROWS); break;
            case 4: interleaved_dot(base, group, nb, act, m0, 4, bias, y, N, g * GROUP_ROWS); break;
            case 3: interleaved_dot(base, group, nb, act, m0, 3, bias, y, N, g * GROUP_ROWS); break;
            case 2: interleaved_dot(base, group, nb, act, m0, 2, bias, y, N, g * GROUP_ROWS); break;
            default: interleaved_dot(base, group, nb, act, m0, 1, bias, y, N, g * GROUP_ROWS); break;
            }
        }
    }
}

/* y [M, N] = x [M, K] times interleaved blocks of `base` (+ bias). Returns 0, 1 when out of memory, 2 for a type with
 * no interleaved layout or a CPU without the instructions. */
static int interleaved_gemm(const float *x, int64_t M, int64_t K, int base, const uint8_t *w, const float *bias, float *y,
                      int64_t N, int num_threads) {
    if (!is_interleavable(base) || K % weights_per_block(base) != 0 || !kv_gguf_interleaved_supported()) return 2;
    if (is_k_type(base)) return interleaved_k_gemm(x, M, K, base, w, bias, y, N, num_threads);
    const int64_t nb = K / QK;
    size_t q_bytes = ((size_t)(M * K) + 63) & ~(size_t)63, per_block = (size_t)(M * nb) * 4;
    uint8_t *buffer = aligned_alloc(64, q_bytes + 3 * ((per_block + 63) & ~(size_t)63));
    if (!buffer) return 1;
    InterleavedActivations act = {(int8_t *)buffer, (float *)(buffer + q_bytes),
                            (float *)(buffer + q_bytes + ((per_block + 63) & ~(size_t)63)),
                            (int32_t *)(buffer + q_bytes + 2 * ((per_block + 63) & ~(size_t)63))};
    const int centre = interleaved_centre(base);
#pragma omp parallel for num_threads(num_threads) schedule(static) if (M > 1)
    for (int64_t m = 0; m < M; m++) {
        for (int64_t b = 0; b < nb; b++) {
            const int64_t i = m * nb + b;
            int sum;
            act.d[i] = round_block(x + m * K + b * QK, QK, act.q + i * QK, &sum);
            act.s[i] = act.d[i] * (float)sum;
            act.start[i] = -centre * sum;
        }
    }
    switch (base) {
    case KV_Q4_0: interleaved_gemm_type(KV_Q4_0, w, M, nb, &act, bias, y, N, num_threads); break;
    case KV_Q4_1: interleaved_gemm_type(KV_Q4_1, w, M, nb, &act, bias, y, N, num_threads); break;
    case KV_Q5_0: interleaved_gemm_type(KV_Q5_0, w, M, nb, &act, bias, y, N, num_threads); break;
    case KV_Q5_1: interleaved_gemm_type(KV_Q5_1, w, M, nb, &act, bias, y, N, num_threads); break;
    case KV_Q8_0: interleaved_gemm_type(KV_Q8_0, w, M, nb, &act, bias, y, N, num_threads); break;
    default: interleaved_gemm_type(KV_IQ4_NL, w, M, nb, &act, bias, y, N, num_threads); break;
    }
    free(buffer);
    return 0;
}

#pragma GCC pop_options
