/* GGUF blocks interleaved by rows and the register-tiled products over them, for gguf_blocks.c, which includes this
 * file: the layout of the 32-weight types here and of the 256-weight types in gguf_interleaved_k.c, the products
 * in gguf_interleaved_kernels.c (written once, included below for 256-bit registers in this build's instructions
 * and for 512-bit ones with their own target, called only where the CPU has AVX-512 F/BW/VL and VNNI).
 *
 * Why: the row kernel (dot_row) multiplies one weight row at a time, so every 32 products pay for a scale
 * broadcast, a conversion and a horizontal sum, and batched decode and prefill ran at the 1-row rate per
 * row. Here a 512-bit register holds the same 4 weights of 16 weight rows (a 256-bit one of 8), so one vpdpbusd
 * with one 4-byte activation quad broadcast adds 64 products into 16 output columns, and a block's scales are a
 * vector of the rows' fp16 scales. Unpacking a block (nibbles to bytes) is paid once per tile of up to V_MAX_R
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

enum { KV_INTERLEAVED = 0x200, KV_NARROW = 0x400 }; /* NARROW: the 256-bit kernel even where the 512-bit one runs */

#define GROUP_ROWS 16 /* weight rows per group: one 512-bit register of int32 sums */

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

/* 1 when this CPU runs the 512-bit kernels (AVX-512 F, BW, VL and VNNI). */
int kv_gguf_interleaved_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}

/* Activation rows rounded to blocks of 32 for the 32-weight types: q int8 [M*K], and per block d (scale), s (d *
 * sum q: the offset types' term) and start (-centre * sum q: where the integer sums begin). */
typedef struct {
    int8_t *q;
    float *d, *s;
    int32_t *start;
} InterleavedActivations;

/* Activation rows rounded per 256 values for the 256-weight types: q int8 [M*K]; d per 256; sum16 and sum32, the
 * integer sums of each 16 and 32 values; min_pairs, 4 words per 256 values, the sum32s as int16 pairs in the
 * order the Q4_K / Q5_K minimums are paired: (0, 2), (1, 3), (4, 6), (5, 7) (a sum of 32 int8 fits 16 bits). */
typedef struct {
    int8_t *q;
    float *d;
    int32_t *sum16, *sum32, *min_pairs;
} KActivations;

/* Lanes 0 .. count-1 of a 256-bit float vector, as the mask maskload / maskstore take. */
static inline __m256i column_mask_256(int64_t count) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)count), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* The 256-bit kernels: this build's instructions (dot4: vpdpbusd with VNNI, else vpmaddubsw + vpmaddwd). */
#define V_NAME(name) name##_256
#define V_LANES 8
#define V_HALVES 2
#define V_MAX_R 4   /* activation rows per pass of the 32-weight types (16 registers) */
#define V_I __m256i
#define V_F __m256
#define V_LOADU(p) _mm256_loadu_si256((const __m256i *)(p))
#define V_AND _mm256_and_si256
#define V_OR _mm256_or_si256
#define V_SRLI16 _mm256_srli_epi16
#define V_SLLI16 _mm256_slli_epi16
#define V_SRLI32 _mm256_srli_epi32
#define V_SLLI32 _mm256_slli_epi32
#define V_SRAI32 _mm256_srai_epi32
#define V_SET8(x) _mm256_set1_epi8((char)(x))
#define V_SET32 _mm256_set1_epi32
#define V_SETF _mm256_set1_ps
#define V_ZEROI _mm256_setzero_si256()
#define V_ZEROF _mm256_setzero_ps()
#define V_DOT dot4
#define V_CVT _mm256_cvtepi32_ps
#define V_MULF _mm256_mul_ps
#define V_ADDF _mm256_add_ps
#define V_FMA _mm256_fmadd_ps
#define V_FNMA _mm256_fnmadd_ps
#define V_ADD32 _mm256_add_epi32
#define V_SUB32 _mm256_sub_epi32
#define V_MULLO _mm256_mullo_epi32
#define V_SHUF8 _mm256_shuffle_epi8
#define V_GRID _mm256_broadcastsi128_si256
#define V_HALFS(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define V_U16(p) _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p)))
#define V_LOAD_COLUMNS(p, n) _mm256_maskload_ps((p), column_mask_256(n))
#define V_STORE_COLUMNS(p, n, v) _mm256_maskstore_ps((p), column_mask_256(n), (v))
#include "gguf_interleaved_kernels.c"
#undef V_NAME
#undef V_LANES
#undef V_HALVES
#undef V_MAX_R
#undef V_I
#undef V_F
#undef V_LOADU
#undef V_AND
#undef V_OR
#undef V_SRLI16
#undef V_SLLI16
#undef V_SRLI32
#undef V_SLLI32
#undef V_SRAI32
#undef V_SET8
#undef V_SET32
#undef V_SETF
#undef V_ZEROI
#undef V_ZEROF
#undef V_DOT
#undef V_CVT
#undef V_MULF
#undef V_ADDF
#undef V_FMA
#undef V_FNMA
#undef V_ADD32
#undef V_SUB32
#undef V_MULLO
#undef V_SHUF8
#undef V_GRID
#undef V_HALFS
#undef V_U16
#undef V_LOAD_COLUMNS
#undef V_STORE_COLUMNS

/* The 512-bit kernels, compiled into every build and called only where kv_gguf_interleaved_supported(). */
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni")
static inline __mmask16 column_mask_512(int64_t count) { return (__mmask16)((1u << count) - 1); }
#define V_NAME(name) name##_512
#define V_LANES 16
#define V_HALVES 1
#define V_MAX_R 8
#define V_MAX_R_K 8 /* and of the 256-weight types */
#define V_I __m512i
#define V_F __m512
#define V_LOADU(p) _mm512_loadu_si512((const void *)(p))
#define V_AND _mm512_and_si512
#define V_OR _mm512_or_si512
#define V_SRLI16 _mm512_srli_epi16
#define V_SLLI16 _mm512_slli_epi16
#define V_SRLI32 _mm512_srli_epi32
#define V_SLLI32 _mm512_slli_epi32
#define V_SRAI32 _mm512_srai_epi32
#define V_SET8(x) _mm512_set1_epi8((char)(x))
#define V_SET32 _mm512_set1_epi32
#define V_SETF _mm512_set1_ps
#define V_ZEROI _mm512_setzero_si512()
#define V_ZEROF _mm512_setzero_ps()
#define V_DOT _mm512_dpbusd_epi32
#define V_DOT16 _mm512_dpwssd_epi32
#define V_CVT _mm512_cvtepi32_ps
#define V_MULF _mm512_mul_ps
#define V_ADDF _mm512_add_ps
#define V_FMA _mm512_fmadd_ps
#define V_FNMA _mm512_fnmadd_ps
#define V_ADD32 _mm512_add_epi32
#define V_SUB32 _mm512_sub_epi32
#define V_MULLO _mm512_mullo_epi32
#define V_SHUF8 _mm512_shuffle_epi8
#define V_GRID _mm512_broadcast_i32x4
#define V_HALFS(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define V_U16(p) _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p)))
#define V_LOAD_COLUMNS(p, n) _mm512_maskz_loadu_ps(column_mask_512(n), (p))
#define V_STORE_COLUMNS(p, n, v) _mm512_mask_storeu_ps((p), column_mask_512(n), (v))
#include "gguf_interleaved_kernels.c"
#pragma GCC pop_options

/* Whether the 256-bit kernel multiplies `base`: the 32-weight types (without VNNI, Q8_0 and IQ4_NL through signed
 * pairs: gguf_interleaved_kernels.c V_SIGNED_PAIRS). */
static inline int narrow_takes(int base) { return !is_k_type(base); }

/* 1 when the 256-bit kernel of this build multiplies `type` (the 512-bit one takes every interleaved type). */
int kv_gguf_interleaved_narrow_takes(int type) { return is_interleavable(type) && narrow_takes(type); }

/* Activation block i (QK_K values at x) of a K-quant product: its int8 values and scale, its sums over each 16 and
 * 32 values, and the 32-value sums paired as the minimums' products take them (KActivations). */
static inline void round_k_block(const float *x, const KActivations *act, int64_t i) {
    int total;
    act->d[i] = round_block(x, QK_K, act->q + i * QK_K, &total);
    for (int g = 0; g < 16; g++) {
        int sum16 = 0;
        for (int k = 16 * g; k < 16 * g + 16; k++) sum16 += act->q[i * QK_K + k];
        act->sum16[i * 16 + g] = sum16;
    }
    for (int j = 0; j < 8; j++) act->sum32[i * 8 + j] = act->sum16[i * 16 + 2 * j] + act->sum16[i * 16 + 2 * j + 1];
    static const int PAIRED[4][2] = {{0, 2}, {1, 3}, {4, 6}, {5, 7}};
    for (int k = 0; k < 4; k++)
        act->min_pairs[i * 4 + k] = (int32_t)((uint32_t)(uint16_t)act->sum32[i * 8 + PAIRED[k][0]] |
                                              (uint32_t)(uint16_t)act->sum32[i * 8 + PAIRED[k][1]] << 16);
}

/* y [M, N] = x [M, K] times interleaved blocks (+ bias): the 512-bit kernel where the CPU has it, unless `type`
 * carries KV_NARROW; the 256-bit one otherwise. Returns 0, 1 when out of memory, 2 for a type with no interleaved
 * layout or that the chosen kernel cannot take. */
static int interleaved_gemm(const float *x, int64_t M, int64_t K, int type, const uint8_t *w, const float *bias,
                            float *y, int64_t N, int num_threads) {
    const int base = type & ~KV_NARROW;
    const int wide = !(type & KV_NARROW) && kv_gguf_interleaved_supported();
    if (!is_interleavable(base) || K % weights_per_block(base) != 0 || (!wide && !narrow_takes(base))) return 2;
    const int64_t block = weights_per_block(base), nb = K / block;
    const size_t q_bytes = ((size_t)(M * K) + 63) & ~(size_t)63, per_block = ((size_t)(M * nb) * 4 + 63) & ~(size_t)63;
    const size_t sum16_bytes = ((size_t)(M * K / 16) * 4 + 63) & ~(size_t)63;
    const size_t sums_bytes = is_k_type(base) ? sum16_bytes + sum16_bytes / 2 + sum16_bytes / 4 + 64 : 2 * per_block;
    uint8_t *buffer = aligned_alloc(64, q_bytes + per_block + sums_bytes);
    if (!buffer) return 1;
    int8_t *q = (int8_t *)buffer;
    float *d = (float *)(buffer + q_bytes);
    uint8_t *sums = buffer + q_bytes + per_block;
    /* One parallel region: the threads round the activations' blocks between them, then share out the weight groups
     * (a region each, with the rounding on one thread while the other waited, cost a 1.1B decode step ~0.2-0.4 ms). */
    if (is_k_type(base)) {
        KActivations act = {q, d, (int32_t *)sums, (int32_t *)(sums + sum16_bytes),
                            (int32_t *)(sums + sum16_bytes + sum16_bytes / 2)};
#pragma omp parallel num_threads(num_threads)
        {
#pragma omp for schedule(static)
            for (int64_t i = 0; i < M * nb; i++) round_k_block(x + i * QK_K, &act, i);
            gemm_k_512(base, w, M, nb, &act, bias, y, N); /* wide: narrow_takes refused them otherwise */
        }
    } else {
        InterleavedActivations act = {q, d, (float *)sums, (int32_t *)(sums + per_block)};
        const int centre = interleaved_centre(base);
#pragma omp parallel num_threads(num_threads)
        {
#pragma omp for schedule(static)
            for (int64_t i = 0; i < M * nb; i++) {
                int total;
                act.d[i] = round_block(x + i * QK, QK, act.q + i * QK, &total);
                act.s[i] = act.d[i] * (float)total;
                act.start[i] = -centre * total;
            }
            if (wide)
                gemm_512(base, w, M, nb, &act, bias, y, N);
            else
                gemm_256(base, w, M, nb, &act, bias, y, N);
        }
    }
    free(buffer);
    return 0;
}
