/* Attention of one new query token per sequence over the paged KV cache (decode steps).
 *
 * query:  float32 [B, Hq, D]
 * caches: [num_blocks, block_size, Hkv, row] (keys and values, one layer) in one of the KV_* formats:
 *         float32, float16 or bfloat16 rows of D values, or int8 rows of D values then their float32
 *         scale (value = q * scale), as engine/ops/kv_format.py writes them
 * blocks: int64   [B, N]   cache blocks each sequence reads, in logical order
 * mask:   uint8   [B, N * block_size] 1 where the key is visible, or NULL for all visible
 * out:    float32 [B, Hq, D]
 * softcap: > 0 caps every scaled score s to softcap * tanh(s / softcap) before the softmax; 0 is off
 *
 * Query head h reads key/value head h / (Hq / Hkv) (grouped-query attention).
 * Reads keys and values in place, where torch's path gathers whole blocks into
 * a dense copy first and pays a dozen op dispatches per layer. Scores and the
 * softmax are float32 with the max subtracted, like the reference
 * (engine/attention/paged.py: paged_attention; engine/attention/reference.py: dense_reference_attention).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2, KV_INT8 = 3 };

/* Bytes of one token's key (or value) for one head. */
static inline int64_t kv_row_bytes(int format, int64_t head_dim) {
    switch (format) {
    case KV_F16:
    case KV_BF16: return 2 * head_dim;
    case KV_INT8: return head_dim + 4;
    default: return 4 * head_dim;
    }
}

/* Values i..i+7 of a cache row as float32 (an int8 row's before its scale). */
static inline __m256 kv_load8(const void *row, int format, int64_t i) {
    switch (format) {
    case KV_F16: return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + i)));
    case KV_BF16: {
        __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + i)));
        return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
    }
    case KV_INT8: {
        __m128i bytes = _mm_loadl_epi64((const __m128i *)((const int8_t *)row + i));
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
    }
    default: return _mm256_loadu_ps((const float *)row + i);
    }
}

static inline float kv_load1(const void *row, int format, int64_t i) {
    switch (format) {
    case KV_F16: return _cvtsh_ss(((const uint16_t *)row)[i]);
    case KV_BF16: {
        uint32_t bits = (uint32_t)((const uint16_t *)row)[i] << 16;
        float value;
        memcpy(&value, &bits, sizeof value);
        return value;
    }
    case KV_INT8: return (float)((const int8_t *)row)[i];
    default: return ((const float *)row)[i];
    }
}

/* What a row's loaded values are multiplied by: an int8 row's scale, else 1. */
static inline float kv_row_scale(const void *row, int format, int64_t head_dim) {
    if (format != KV_INT8) return 1.0f;
    float scale;
    memcpy(&scale, (const int8_t *)row + head_dim, sizeof scale);
    return scale;
}

/* float32 -> bfloat16 bits, rounded to nearest even (quiet NaN kept), as torch converts. */
static inline uint16_t kv_bf16_bits(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* Store x[0..n) as one cache row in `format` (int8: the row's largest magnitude / 127 as its scale, each
 * value x / scale rounded to nearest even and held to -127..127, a zero row all zeros). */
static void kv_store_row(void *row, const float *x, int format, int64_t n) {
    switch (format) {
    case KV_F16: {
        uint16_t *out = row;
        int64_t i = 0;
        for (; i + 8 <= n; i += 8)
            _mm_storeu_si128((__m128i *)(out + i),
                             _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        for (; i < n; i++) out[i] = _cvtss_sh(x[i], _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        return;
    }
    case KV_BF16: {
        uint16_t *out = row;
        for (int64_t i = 0; i < n; i++) out[i] = kv_bf16_bits(x[i]);
        return;
    }
    case KV_INT8: {
        int8_t *out = row;
        float largest = 0.0f;
        for (int64_t i = 0; i < n; i++) largest = fmaxf(largest, fabsf(x[i]));
        float scale = largest / 127.0f;
        for (int64_t i = 0; i < n; i++) {
            float q = scale > 0.0f ? nearbyintf(x[i] / scale) : 0.0f;
            out[i] = (int8_t)fminf(fmaxf(q, -127.0f), 127.0f);
        }
        memcpy(out + n, &scale, sizeof scale);
        return;
    }
    default: memcpy(row, x, (size_t)n * sizeof(float));
    }
}

/* q . row over n values, the row in `format` (its scale applied). */
static inline float kv_dot_row(const float *q, const void *row, int format, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), kv_load8(row, format, i), acc);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    float total = _mm_cvtss_f32(s);
    for (; i < n; i++) total += q[i] * kv_load1(row, format, i);
    return total * kv_row_scale(row, format, n);
}

/* out[i] += w * row[i], the row in `format` (its scale applied). */
static inline void kv_axpy_row(float *out, float w, const void *row, int format, int64_t n) {
    w *= kv_row_scale(row, format, n);
    __m256 wv = _mm256_set1_ps(w);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_fmadd_ps(wv, kv_load8(row, format, i), _mm256_loadu_ps(out + i)));
    for (; i < n; i++) out[i] += w * kv_load1(row, format, i);
}

/* Attention of rows [b] for all heads; query row b starts at query + b * query_row_stride. */
static int decode_attention_capped(const float *query, int64_t query_row_stride, const void *key_cache,
                                   const void *value_cache, const int64_t *blocks, const uint8_t *mask, float *out,
                                   int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                   int64_t block_size, int64_t num_blocks_per_seq, float scale, float softcap,
                                   int kv_format, int num_threads) {
    int capped = softcap > 0.0f; /* loop-invariant: the branch below costs nothing when off */
    int64_t num_keys = num_blocks_per_seq * block_size;
    int64_t group = num_heads / num_kv_heads;
    int64_t row_bytes = kv_row_bytes(kv_format, head_dim);
    int64_t slot_stride = num_kv_heads * row_bytes; /* bytes between consecutive cache slots */
    const char *keys = key_cache, *values = value_cache;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *scores = malloc((size_t)num_keys * sizeof(float));
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t task = 0; task < num_seqs * num_heads; task++) {
            if (!scores) continue;
            int64_t b = task / num_heads, h = task % num_heads, kvh = h / group;
            const float *q = query + b * query_row_stride + h * head_dim;
            const int64_t *table = blocks + b * num_blocks_per_seq;
            const uint8_t *visible = mask ? mask + b * num_keys : NULL;
            float best = -INFINITY;
            for (int64_t k = 0; k < num_keys; k++) {
                if (visible && !visible[k]) continue;
                int64_t slot = table[k / block_size] * block_size + k % block_size;
                float s = kv_dot_row(q, keys + slot * slot_stride + kvh * row_bytes, kv_format, head_dim) * scale;
                if (capped) s = tanhf(s / softcap) * softcap;
                scores[k] = s;
                if (s > best) best = s;
            }
            float *o = out + (b * num_heads + h) * head_dim;
            for (int64_t i = 0; i < head_dim; i++) o[i] = 0.0f;
            if (best == -INFINITY) continue; /* no visible key: zeros (never happens for real rows) */
            float total = 0.0f;
            for (int64_t k = 0; k < num_keys; k++) {
                if (visible && !visible[k]) continue;
                float p = expf(scores[k] - best);
                total += p;
                int64_t slot = table[k / block_size] * block_size + k % block_size;
                kv_axpy_row(o, p, values + slot * slot_stride + kvh * row_bytes, kv_format, head_dim);
            }
            float inv = 1.0f / total;
            for (int64_t i = 0; i < head_dim; i++) o[i] *= inv;
        }
        free(scores);
    }
    return failed;
}

/* Returns 0 on success, 1 if a scratch buffer could not be allocated. */
int kv_decode_attention(const float *query, const void *key_cache, const void *value_cache,
                        const int64_t *blocks, const uint8_t *mask, float *out, int64_t num_seqs,
                        int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                        int64_t num_blocks_per_seq, float scale, float softcap, int kv_format, int num_threads) {
    return decode_attention_capped(query, num_heads * head_dim, key_cache, value_cache, blocks, mask, out, num_seqs,
                                   num_heads, num_kv_heads, head_dim, block_size, num_blocks_per_seq, scale, softcap,
                                   kv_format, num_threads);
}

/* Store new keys or values x: float32 [T, Hkv, D] into the cache slots slot_mapping [T], in `kv_format`
 * (the rows engine/ops/kv_format.py `store` writes, bit for bit). */
void kv_store_rows(const float *x, void *cache, const int64_t *slot_mapping, int64_t num_tokens,
                   int64_t num_kv_heads, int64_t head_dim, int kv_format) {
    int64_t row_bytes = kv_row_bytes(kv_format, head_dim);
    for (int64_t t = 0; t < num_tokens; t++)
        for (int64_t h = 0; h < num_kv_heads; h++)
            kv_store_row((char *)cache + (slot_mapping[t] * num_kv_heads + h) * row_bytes,
                         x + (t * num_kv_heads + h) * head_dim, kv_format, head_dim);
}
